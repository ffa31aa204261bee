#!/usr/bin/env bash
# Run a few train_tiny.py configurations concurrently on one GPU (the model is launch-bound, so the GPU has
# room for several), size the step count from a short measured benchmark, and package the results for the
# device tool's $OUT (at most 8 files, 16 MiB each): logs of every run + the two best checkpoints split in parts.
#   usage: bash scripts/gpu_sweep.sh DATA_DIR OUT_DIR TARGET_SECONDS
set -euo pipefail
DATA=$1; OUT=$2; TARGET=${3:-300}
PY=${PY:-python3}
MIN_STEPS=${MIN_STEPS:-200}
EXTRA=${EXTRA:-}  # extra train_tiny.py arguments (local dry runs: --preset smoke --device cpu)
W=/tmp/sweep; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
declare -A CFG=(
  [A]="--batch 32 --lr 2e-3 --mtp-weights 0.5,0.3,0.2 --distill 0.5"
  [B]="--batch 64 --lr 2e-3 --mtp-weights 0.5,0.3,0.2 --distill 0.5"
  [C]="--batch 32 --lr 1.5e-3 --mtp-weights 1.0,0.6,0.4 --distill 0.7"
)
nvidia-smi -L || true
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
# 1) benchmark: all configs concurrently, 40 steps
for n in "${!CFG[@]}"; do
  $PY scripts/train_tiny.py train --data $DATA --out $W/bench_$n --steps 40 --eval-every 100000 --log-every 10 ${CFG[$n]} $EXTRA > $W/bench_$n.log 2>&1 &
done
wait
for n in "${!CFG[@]}"; do
  per=$($PY - "$W/bench_$n.log" <<'EOF'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"train"' in l]
a, b = recs[1], recs[-1]  # skip step 0 (warm-up)
print((b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"]))
EOF
)
  steps=$($PY -c "print(max($MIN_STEPS, min(4000, int($TARGET / $per) // 100 * 100)))")
  echo "config $n: ${per} s/step -> $steps steps"
  echo "$steps" > $W/steps_$n
done
# 2) the runs
for n in "${!CFG[@]}"; do
  steps=$(cat $W/steps_$n)
  $PY scripts/train_tiny.py train --data $DATA --out $W/run_$n --steps $steps --eval-every 100 --log-every 25 \
      --max-minutes $($PY -c "print(round($TARGET * 1.4 / 60, 2))") ${CFG[$n]} $EXTRA > $W/run_$n.log 2>&1 &
done
wait || true
# 3) package: logs + summaries of all runs in one tarball, the two best checkpoints (by val agreement proxy)
$PY - "$W" <<'EOF' > $W/ranking.txt
import json, sys, pathlib
w = pathlib.Path(sys.argv[1]); rows = []
for d in sorted(w.glob("run_*")):
    s = d / "train_summary.json"
    if not s.exists():
        continue
    b = json.loads(s.read_text())["best"]
    a1, a2, a3 = b.get("val_mtp1_agree", 0), b.get("val_mtp2_agree", 0), b.get("val_mtp3_agree", 0)
    proxy = 1 + a1 + a1 * a2 + a1 * a2 * a3
    rows.append((proxy, d.name, b["val_main_ce"]))
for r in sorted(rows, reverse=True):
    print(f"{r[1]} proxy_emitted_k3={r[0]:.3f} val_main_ce={r[2]:.4f}")
EOF
cat $W/ranking.txt
mkdir -p $OUT
tar czf $OUT/runs.tar.gz -C $W --exclude='*.safetensors' $(cd $W && ls -d run_* bench_*.log ranking.txt steps_* 2>/dev/null)
i=0
for name in $(awk '{print $1}' $W/ranking.txt | head -2); do
  split -b 15M -d $W/$name/model.safetensors $OUT/${name}.safetensors.part
  i=$((i+1))
done
ls -la $OUT
