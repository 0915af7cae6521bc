#!/usr/bin/env bash
# Everything the GPU acceptance of the GPU-performance and tuner issues needs, in the order a
# lent GPU session should run it (each part fits one 10-minute device call):
#
#   bash bench/gpu_session.sh check OUTDIR   # ops, CUDA tests, demo, DeepSpeed integration tests (~8 min)
#   bash bench/gpu_session.sh 2b OUTDIR      # bench/gpu_vs_stock.py --sizes 2b, with the recorded report (~10 min)
#   bash bench/gpu_session.sh 4b OUTDIR      # bench/gpu_vs_stock.py --sizes 4b, profile reused (~10 min)
#
# On the device machine: `source .gpu/env.sh && bash bench/gpu_session.sh PART $OUT` (see
# ../shared/tools/gpu-prep). The profile measured by the first bench part is kept in OUTDIR and
# reused by the next. Results: OUTDIR/*.json and *.log.
set -uo pipefail
part=${1:?usage: gpu_session.sh check|2b|4b OUTDIR}
out=${2:?usage: gpu_session.sh check|2b|4b OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvidia-smi -L
case "$part" in
  check)
    offloadctl info --build 2>&1 | tail -8
    python3 -m pytest -q -x tests/test_numerics.py -k "cuda or flat" 2>&1 | tee "$out/cuda-tests.log" | tail -5
    d=$(mktemp -d)
    offloadctl train --num_gpus 1 --nvme "$d" --run-dir "$d/run" examples/train_gpt.py --steps 30 2>&1 \
      | tee "$out/demo.log" | grep -v '^\[' | tail -20
    python3 -m pytest -q -x tests/test_deepspeed_integration.py -k "1rank or lane" 2>&1 | tee "$out/ds-tests.log" | tail -5
    ;;
  2b|4b)
    profile="$out/profile.toml"
    if [ ! -f "$profile" ]; then
      offloadctl profile save gpu-bench --quick --output "$profile" --force 2>&1 | tail -3
    fi
    python3 bench/gpu_vs_stock.py --sizes "$part" --iters 5 --profile "$profile" --json "$out/bench-$part.json" \
      --report "$out/report" \
      2>&1 | tee "$out/bench-$part.log" | tail -30
    ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
