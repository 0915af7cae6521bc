#!/usr/bin/env bash
# The GPU session, in parts that each fit one call of the device tool: under 8 minutes of
# command time, and at most 8 files back from OUT (each part leaves OUT/<part>.json with its
# figures, OUT/<part>.tgz with its logs and reports, and, where made, ops.tgz and profile.toml).
#
#   bash bench/gpu_session.sh check   OUT   # ops, CUDA tests, GPU-path checks, demo, DeepSpeed rows (~7 min)
#   bash bench/gpu_session.sh profile OUT   # the machine's profile, for the bench parts (~2 min)
#   bash bench/gpu_session.sh 2b      OUT   # bench/gpu_vs_stock.py at 2B: our rows first, then stock's (~7 min)
#   bash bench/gpu_session.sh 4b      OUT   # the same where the state does not fit the GPU (~7 min)
#
# On the device machine, carrying [".gpu"]:  source .gpu/env.sh && bash bench/gpu_session.sh PART "$OUT"
#
# Every call may start on a bare machine (it is handed back 30 s after a call), so what later
# calls need travels in the working tree, never in OUT: bring back OUT/ops.tgz as .gpu/ops.tgz
# (DeepSpeed's built ops; gpu-prep keeps it) and OUT/profile.toml as .gpu/profile.toml. The
# device tool empties OUT before each call. Swap files go to a directory whose file system takes
# O_DIRECT (the device's /tmp may be an overlay or tmpfs): found below, and recorded.
set -uo pipefail
part=${1:?usage: gpu_session.sh check|profile|2b|4b OUT}
out=${2:?usage: gpu_session.sh check|profile|2b|4b OUT}
mkdir -p "$out"
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-session.XXXXXX")
trap 'rm -rf "$work"' EXIT
logs="$work/logs"; mkdir -p "$logs"
nvidia-smi -L | tee "$logs/gpu.txt"

odirect_dir() {  # the first candidate whose file system takes O_DIRECT (engine.storage.paths.check_usable)
  for d in /var/tmp /tmp "$PWD/.gpu/swap" "$HOME"; do
    mkdir -p "$d/offloadctl-swap" 2>/dev/null || continue
    if python3 -c "import sys; from engine.storage.paths import check_usable; check_usable(sys.argv[1])" \
         "$d/offloadctl-swap" 2>>"$logs/odirect.txt"; then
      findmnt -T "$d" >>"$logs/odirect.txt" 2>&1
      echo "$d/offloadctl-swap"; return 0
    fi
  done
  echo "no O_DIRECT directory found (see odirect.txt)" >&2; return 1
}

profile=.gpu/profile.toml
finish() {  # one JSON of figures and one archive of logs per part
  tar -C "$work" -czf "$out/$part.tgz" logs $( [ -d "$work/report" ] && echo report ) 2>/dev/null
  ls -la "$out"
}

case "$part" in
  check)
    swap=$(odirect_dir) || { finish; exit 1; }
    offloadctl info --build --json >"$logs/info.json" 2>"$logs/info.err"; tail -3 "$logs/info.err"
    tar -C "${TORCH_EXTENSIONS_DIR:-/tmp/torch-ext}" -czf "$out/ops.tgz" . 2>/dev/null  # bring back as .gpu/ops.tgz
    # The CUDA tests: numerics on CUDA, the GPU path's ordering, events, lane memory (issue 18).
    timeout 150 python3 -m pytest -q -p no:cacheprovider --basetemp="$swap/pytest" \
      tests/test_gpu_path.py tests/test_numerics.py -k "cuda or flat or gpu_path" 2>&1 | tee "$logs/cuda-tests.log" | tail -4
    # The demo as `make demo` runs it (the device's torch and wheels, not a fresh venv: no network there).
    timeout 120 offloadctl train --num_gpus 1 --nvme "$swap" --run-dir "$work/report/demo-run" \
      examples/train_gpt.py --steps 30 >"$logs/demo.log" 2>&1; echo "demo rc $?"; tail -4 "$logs/demo.log"
    # DeepSpeed rows on one GPU: NVMe tier, the lane's bookkeeping, and the GPU default.
    timeout 200 python3 -m pytest -q -p no:cacheprovider --basetemp="$swap/pytest-ds" tests/test_deepspeed_integration.py \
      -k "1rank-fp32 or 1rank-bf16 or lane-on-cpu-bf16 or gpu_default" 2>&1 | tee "$logs/ds-tests.log" | tail -4
    python3 - "$logs" "$out/check.json" <<'EOF'
import json, re, sys
logs, dst = sys.argv[1], sys.argv[2]
def summary(name):
    try:
        lines = [ln for ln in open(f"{logs}/{name}") if re.search(r"passed|failed|error", ln)]
        return lines[-1].strip() if lines else "no summary"
    except OSError:
        return "missing"
json.dump({"cuda_tests": summary("cuda-tests.log"), "ds_tests": summary("ds-tests.log"),
           "demo_tail": open(f"{logs}/demo.log").read()[-1500:]}, open(dst, "w"), indent=1)
EOF
    finish ;;
  profile)
    swap=$(odirect_dir) || { finish; exit 1; }
    timeout 300 offloadctl profile save gpu-session --quick --nvme "$swap" --output "$out/profile.toml" --force \
      >"$logs/profile.log" 2>&1; tail -3 "$logs/profile.log"
    echo "bring back: $out/profile.toml -> .gpu/profile.toml"
    finish ;;
  2b|4b)
    [ -f "$profile" ] || { echo "no $profile: run the profile part first and bring profile.toml back"; exit 1; }
    timeout 450 python3 bench/gpu_vs_stock.py --sizes "$part" --iters 5 --row-timeout 110 --profile "$profile" \
      --json "$out/$part.json" --report "$work/report" 2>&1 | tee "$logs/bench-$part.log" | tail -30
    finish ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
