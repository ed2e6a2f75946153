"""python ab_run.py SO_DIR script.py args...: runs script with jax_wgrad._wgrad_ffi_cpu
loaded from the copy of the extension in SO_DIR ('-': the installed one), so a saved
build of the handler (before/after) can be compared in the same checkout."""
import sys, os, runpy, importlib.machinery, importlib.util
so_dir = sys.argv[1]
if so_dir != '-':
    import ctypes, scipy_openblas32 as sob
    ctypes.CDLL(os.path.join(sob.get_lib_dir(), 'libscipy_openblas.so'), mode=ctypes.RTLD_GLOBAL)
    path = [os.path.join(so_dir, f) for f in os.listdir(so_dir) if f.startswith('_wgrad_ffi_cpu')][0]
    class F:
        @staticmethod
        def find_spec(name, p=None, target=None):
            if name == 'jax_wgrad._wgrad_ffi_cpu':
                return importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.ExtensionFileLoader(name, path))
            return None
    sys.meta_path.insert(0, F)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name='__main__')
