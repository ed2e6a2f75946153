// What a handler declares to XLA: asks a handler for its metadata the way XLA does at
// registration (a call frame carrying only the metadata extension, no API, no buffers),
// so that Python can check, before registering anything, that this jax accepts it.
// Included by the Python extension modules only.
#ifndef JAX_WGRAD_FFI_METADATA_H_
#define JAX_WGRAD_FFI_METADATA_H_

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include "xla/ffi/api/c_api.h"

namespace jax_wgrad {

struct HandlerMetadata {
  int api_major = 0;             // XLA FFI API version of the headers it was built with
  int api_minor = 0;
  uint32_t traits = 0;           // XLA_FFI_Handler_Traits bits
  bool command_buffer_compatible = false;
};

inline HandlerMetadata QueryMetadata(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  metadata.api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  frame.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  frame.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  if (handler(&frame) != nullptr) {
    // Only a struct-size mismatch can fail here, and the frame is built from the same
    // headers as the handler; the error object cannot be freed without an API.
    throw std::runtime_error("the handler refused the metadata query");
  }
  HandlerMetadata out;
  out.api_major = metadata.api_version.major_version;
  out.api_minor = metadata.api_version.minor_version;
  out.traits = static_cast<uint32_t>(metadata.traits);
  out.command_buffer_compatible =
      (metadata.traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE) != 0;
  return out;
}

// {"api_version": (major, minor), "traits": bits, "command_buffer_compatible": bool}
inline pybind11::dict MetadataDict(XLA_FFI_Handler* handler) {
  const HandlerMetadata m = QueryMetadata(handler);
  pybind11::dict d;
  d["api_version"] = pybind11::make_tuple(m.api_major, m.api_minor);
  d["traits"] = m.traits;
  d["command_buffer_compatible"] = m.command_buffer_compatible;
  return d;
}

// Whether CMake built this module against FFI headers newer than the oldest supported
// jax's, because the builder allowed it (JAX_WGRAD_ALLOW_NEWER_FFI_API=ON).
#ifdef JAX_WGRAD_NEWER_FFI_BUILD
inline constexpr bool kBuiltForNewerFfiApi = true;
#else
inline constexpr bool kBuiltForNewerFfiApi = false;
#endif

// Adds to a handler module what its handlers declare: `handler_metadata()` (per target
// name, the execute handler's metadata) and `built_for_newer_ffi_api`.
inline void DefineHandlerFacts(
    pybind11::module_& m,
    std::initializer_list<std::pair<const char*, XLA_FFI_Handler*>> execute_handlers) {
  std::vector<std::pair<const char*, XLA_FFI_Handler*>> handlers(execute_handlers);
  m.def("handler_metadata", [handlers]() {
    pybind11::dict d;
    for (const auto& [name, handler] : handlers) d[name] = MetadataDict(handler);
    return d;
  }, "What each execute handler declares to XLA (FFI API version, traits).");
  m.attr("built_for_newer_ffi_api") = kBuiltForNewerFfiApi;
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_METADATA_H_
