#!/bin/bash
# usage: step_ab.sh OUT REPS "v1 v2 ..." [extra args]
# Runs benchmarks/step_vs_plain_jax.py (fp32, --bf16) with each saved handler build
# /tmp/perf_ab/<v>/ (ab_run.py), in the environment as given and without
# OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE, versions interleaved; one JSON line per run.
out=$1; reps=$2; vers=$3; shift 3
cd /work/wt-perf
for r in $(seq $reps); do
 for envn in env native; do
  for f in "" "--bf16"; do
   for v in $vers; do
    if [ $envn = native ]; then E="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"; else E=""; fi
    line=$($E .venv/bin/python /work/wt-perf/notes/issue17_cpu_perf/ab_run.py /tmp/perf_ab/$v benchmarks/step_vs_plain_jax.py $f "$@" 2>/dev/null | tail -1)
    echo "{\"ver\": \"$v\", \"env\": \"$envn\", \"load\": \"$(cut -d' ' -f1 /proc/loadavg)\", \"row\": $line}" >> $out
   done
  done
 done
done
