#!/usr/bin/env bash
# Loss and grad-norm curves of the example before (c61aade, unrolled layers, GPTStages) and
# after (stage programs, layers in a scan) issue 19, on the layouts the issue names.
# Usage: bash notes/issue19_curves/compare.sh OLD_WORKTREE OUT_DIR   (from the repo root)
set -euo pipefail
OLD=$1; OUT=$2; mkdir -p "$OUT"
SITE=$(.venv/bin/python -c 'import jax, os; print(os.path.dirname(os.path.dirname(jax.__file__)))')
SMALL="--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 16 --lr 3e-3 --no-progress --seed 3 --train-iters 6"
declare -A LAYOUTS=(
  [dp8]=""
  [tp2pp2-sp-fused-defer-distopt]="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel --gradient-accumulation-fusion --defer-embedding-wgrad-compute --use-distributed-optimizer --overlap-grad-reduce"
  [tp2pp4-zbh1]="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --gradient-accumulation-fusion --pipeline-schedule zb-h1"
  [moe-ep2pp2]="--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-experts 4 --moe-layer-freq 2 --gradient-accumulation-fusion --moe-grouped-gemm --use-distributed-optimizer"
)
for name in "${!LAYOUTS[@]}"; do
  .venv/bin/python examples/pretrain_gpt.py $SMALL ${LAYOUTS[$name]} --metrics-file "$OUT/$name.after.jsonl" > "$OUT/$name.after.log" 2>&1
  (cd "$OLD" && LD_LIBRARY_PATH="$SITE/scipy_openblas32/lib" PYTHONPATH="$OLD:$SITE" "$OLDPWD/.venv/bin/python" -S examples/pretrain_gpt.py $SMALL ${LAYOUTS[$name]} --metrics-file "$OUT/$name.before.jsonl" > "$OUT/$name.before.log" 2>&1)
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for before in sorted(out.glob("*.before.jsonl")):
    name = before.name.split(".")[0]
    a = [json.loads(l) for l in before.read_text().splitlines()]
    b = [json.loads(l) for l in (out / f"{name}.after.jsonl").read_text().splitlines()]
    for key in ("loss", "grad_norm"):
        x, y = [r[key] for r in a], [r[key] for r in b]
        rel = max(abs(p - q) / abs(p) for p, q in zip(x, y))
        print(f"{name:32s} {key:9s} bitwise={x == y!s:5s} max rel diff={rel:.2e}")
PY
