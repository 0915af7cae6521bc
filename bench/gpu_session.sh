#!/usr/bin/env bash
# The GPU session (issue 32), in stages: each stage is ONE call of the device tool, bounded by its
# own clock (GPU_SESSION_BUDGET_S, default 510 s from its start; with env.sh's ~30 s, about 9 min
# of the 10 the tool allows), and leaves under OUT:
#   OUT/stageN.json       its figures, written as it goes (with every figure the device's name as
#                         torch and nvidia-smi give it, and the device memory the rows were allowed)
#   OUT/stageN-logs.tgz   its logs (and reports), at most 15 MiB
#   OUT/ops.tgz           DeepSpeed's built ops, debug info stripped (stage 1; later stages only when
#                         they had to build them), with the host-kernel choice our first row wrote
#   OUT/profile.toml      the machine's profile (stage 2)
# and prints a short table. Stages, in order of value (expected command time on a bare machine):
#
#   stage1  works, and the headline (~9 min): ops build (background) beside the CUDA tests (the
#           GPU path in-process and through DeepSpeed, numerics); at 4b (the state does not fit
#           the rows' device memory beside the model, see below): offloadctl default, stock
#           ZeRO-3 CPU offload (bf16, gradient_clipping 1.0), 5 iterations each, 180 s kept for
#           stock (it needs 110-170 s at 4b); ops.tgz after these two; then, as time allows,
#           offloadctl with the device lane forced to 1 and stock Twin-Flow 0.7.
#   stage2  4b calibration (~9 min): offloadctl profile save --quick (profile.toml, the predicted
#           column), our row and a recorded stock row for `offloadctl report`, then forced fractions
#           0 and 0.5 and Twin-Flow 0.5 as time allows.
#   stage3  2b, the state fits (~9 min): DeepSpeed integration tests on CUDA beside the ops build;
#           offloadctl default, stock no offload, stock CPU offload, then Twin-Flow 0.3, 0.1, 0.5;
#           our losses against stock's within bf16's tolerance (rtol 2e-3, in the JSON).
#   stage4  NVMe (~9 min): the disk measured (free space, 1 GiB O_DIRECT write and read); the
#           largest of 4b, 2b, 1b whose ZeRO-Infinity swap fits the disk; offloadctl --nvme DIR
#           --host-cache 0 --device-cache 0 against stock ZeRO-Infinity (offload_optimizer nvme,
#           aio block GPU_SESSION_ZI_AIO); `make demo` as shipped; then offloadctl --nvme with its
#           default device cache as time allows.
#   stage5  the tuner and the RLHF loop on CUDA (~9 min): at 2b with no device cache, offloadctl
#           from device fraction 0 with the tuner on (the fraction unpinned once the run has
#           registered) for 35 iterations against static fractions 0.5, 1, 0 (goal: within 5% of
#           the best by iteration 30); offload_states/reload_states and checkpoint round trips.
#
# The device calls, one per stage, in this order (no kind can be named: only H200s are lent):
#   run(command='source .gpu/env.sh && bash bench/gpu_session.sh stage1 "$OUT"', carry=[".gpu"], timeout_s=600)
#   ... the same with stage2, stage3, stage4, stage5 in place of stage1.
# The sizes are planned for an H100 80GB (4b: the state does not fit; 2b: it fits). On a card over
# 100 GB (an H200: about 150 GB as torch sees it) the bench rows, stock and ours, are allowed an H100
# 80GB's 85.5 GB: a ballast process holds the rest (bench/gpu_vs_stock.py --gpu-memory-as auto).
# offloadctl's device-tier margin is taken from the memory the process may use (engine.gpumem.
# usable_bytes: the ballast's memory is another process's), 5.1 GB of those 85.5 GB, not 6% of the
# card's 150 GB (9.0 GB). The JSON and the table give the card's name and memory, the memory the
# rows were allowed, and each step record the engine's own figure (device_usable_bytes).
# Before stage 1: ../shared/tools/gpu-prep (fills .gpu/). After stage 1: cp <files_at>/ops.tgz
# .gpu/ops.tgz (env.sh unpacks it: no op build in later stages, each then has ~2 min more for rows).
# After stage 2: cp <files_at>/profile.toml .gpu/profile.toml (kept for later sessions; no stage
# needs it: they run with --profile none).
#
# Dry run on a CPU machine (the same steps, rows, JSON, archives, kills; CUDA-only steps become
# `pytest --collect-only` of the same selection; size cpu; not GPU figures):
#   GPU_SESSION_SIZE=cpu GPU_SESSION_ITERS=3 GPU_SESSION_BUDGET_S=420 bash bench/gpu_session.sh stage1 /tmp/out
#
# CPU check, first: where os.cpu_count() is more than this process may use (a cpuset), the stage says
# so in one line; offloadctl's node-bandwidth probe may respawn itself without end there (issue 43),
# so the stage measures the node's host memory bandwidth at once on the CPUs it may use (what that
# fix measures), keeps it where the rows read it, and goes on.
#
# Every row runs in a session of its own (bench/gpu_vs_stock.py); each step here runs under
# `timeout`, in its own process group. Every such group is registered in WORK/pgids: on SIGTERM,
# SIGINT or SIGHUP this script sends them SIGTERM, then SIGKILL 10 s later, and writes the JSON
# and the logs; a watchdog in a session of its own does the same if this script is killed outright.
# Swap files go to a directory whose file system takes O_DIRECT (the device's /tmp may be an
# overlay or tmpfs): found below, and recorded.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

ext_dir() { python3 -c 'import os, sys; print(os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions"))'; }

pack_ops() {  # OUT WORK: the built ops, stripped of debug info, as OUT/ops.tgz (if under 15 MiB); the
  # node's memory bandwidth kept beside them stays out (each machine measures its own, cpuset or not)
  local dst=$1 work=$2 ext copy size max=$((15 << 20)) choice=no kept=false
  ext=$(ext_dir); copy=$work/ops-copy
  # A copy is stripped, not the ops in use (the dry run's are this machine's own build).
  rm -rf "$copy" && cp -a "$ext" "$copy" || { echo "pack-ops: cannot copy $ext"; return 1; }
  [ -f "$copy/offloadctl-host-kernel.json" ] && choice=yes
  if command -v strip >/dev/null; then
    find "$copy" \( -name '*.so' -o -name '*.o' \) -exec strip --strip-debug {} +
  else
    echo "pack-ops: no strip here: the archive keeps the debug info"
  fi
  tar -C "$copy" --exclude=./.ninja-bin --exclude='./*/lock' --exclude='./offloadctl-memory-bandwidth.json*' \
    -czf "$work/ops.tgz" .
  size=$(stat -c %s "$work/ops.tgz")
  if [ "$size" -le "$max" ]; then
    mv "$work/ops.tgz" "$dst/ops.tgz"; kept=true
    echo "pack-ops: ops.tgz $((size >> 10)) KiB (host-kernel choice in it: $choice): bring it back as .gpu/ops.tgz"
  else
    echo "pack-ops: ops.tgz is $((size >> 20)) MiB, over 15 MiB: not brought back"
  fi
  rm -rf "$copy"
  printf '{"bytes": %s, "brought_back": %s, "host_kernel_choice": "%s", "from": "%s"}\n' \
    "$size" "$kept" "$choice" "$ext" >"$work/extra-ops-archive.json"
}

if [ "${1:-}" = pack-ops ]; then pack_ops "$2" "$3"; exit; fi

usage="usage: gpu_session.sh stage1|stage2|stage3|stage4|stage5 OUT"
stage=${1:?$usage}; out=${2:?$usage}
case "$stage" in stage[1-5]) ;; *) echo "$usage"; exit 2 ;; esac
t0=$(date +%s)
budget=${GPU_SESSION_BUDGET_S:-510}
reserve=25          # for the JSON, the archives and a kill's grace after the last row
dry=0; big=4b mid=2b
if [ "${GPU_SESSION_SIZE:-}" = cpu ]; then
  dry=1; big=cpu; mid=cpu
  [ -x .venv/bin/python ] && export PATH=$root/.venv/bin:$PATH   # this machine's torch and offloadctl
  # One build directory for every row, as env.sh's on the device: stock's plain `deepspeed` would
  # otherwise JIT-build cpu_adam in ~/.cache (minutes here), and a row killed then leaves torch's
  # lock file there, on which every later stock row waits for ever.
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$root/.venv/torch_extensions}
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
# CPU check, at once (see the header).
read -r ncpu naff < <(python3 -c 'import os; print(os.cpu_count() or 0, len(os.sched_getaffinity(0)))' 2>/dev/null \
  || echo "0 0")
cpuset=0
if [ "$naff" -gt 0 ] && [ "$ncpu" -gt "$naff" ]; then
  cpuset=1
  echo "gpu_session: CPU check: this process may use $naff of the machine's $ncpu CPUs (a cpuset): \
offloadctl's node-bandwidth probe may respawn itself without end here (issue 43); the stage goes on, \
measuring the node's memory bandwidth on these $naff CPUs first and keeping it for the rows"
fi
iters=${GPU_SESSION_ITERS:-5}
# The least time a row needs: a 4b row needs more (stock ZeRO-3 CPU offload at 4b: 110-170 s, pinning
# its 52 GB through torch's power-of-two allocator on first-touch memory). Time is kept for each
# required row still to come (the headline's stock row), and an optional row starts only with it.
min_row=${GPU_SESSION_MIN_ROW_S:-$([ $dry = 1 ] && echo 40 || echo 120)}
min_row_4b=${GPU_SESSION_MIN_ROW_4B_S:-$([ $dry = 1 ] && echo 40 || echo 180)}
row_cap=${GPU_SESSION_ROW_CAP_S:-$([ $dry = 1 ] && echo 120 || echo 300)}
zi_aio=${GPU_SESSION_ZI_AIO:---aio-block-size 1048576 --aio-queue-depth 32 --aio-intra-op 8}
mkdir -p "$out"; out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-session.XXXXXX")
logs=$work/logs pgids=$work/pgids
mkdir -p "$logs/rows" "$pgids"
export GPU_SESSION_PGID_DIR=$pgids
left() { echo $((t0 + budget - reserve - $(date +%s))); }

kill_groups() {  # SIGTERM to every registered group, SIGKILL to what is left 10 s later
  local f pg n
  for f in "$pgids"/*; do [ -e "$f" ] && kill -TERM -- "-${f##*/}" 2>/dev/null; done
  for n in $(seq 50); do
    pg=""; for f in "$pgids"/*; do [ -e "$f" ] && kill -0 -- "-${f##*/}" 2>/dev/null && pg=1; done
    [ -z "$pg" ] && break; sleep 0.2
  done
  for f in "$pgids"/*; do [ -e "$f" ] && kill -KILL -- "-${f##*/}" 2>/dev/null; rm -f "$f"; done
}

# The watchdog: if this script dies without its traps (SIGKILL), its groups die too.
setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done; [ -d "$2" ] || exit 0
  for f in "$2"/*; do [ -e "$f" ] && kill -TERM -- "-${f##*/}" 2>/dev/null; done; sleep 10
  for f in "$2"/*; do [ -e "$f" ] && kill -KILL -- "-${f##*/}" 2>/dev/null; done; rm -rf "$3"' \
  _ $$ "$pgids" "$work" </dev/null >/dev/null 2>&1 &

cat >"$work/emit.py" <<'EOF'
"""The stage's JSON (WORK/meta.json, steps.jsonl, bench-*.json, extra-*.json -> OUT/STAGE.json)
and its short table."""
import glob, json, os, re, sys, time
work, out, stage = os.environ["GS_WORK"], os.environ["GS_OUT"], os.environ["GS_STAGE"]

def load(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default

def pytest_summary(log):
    try:
        lines = [ln.strip() for ln in open(log, errors="replace")
                 if re.search(r"\b(passed|failed|error|errors|skipped|deselected|selected|no tests ran)\b", ln)]
        return lines[-1] if lines else "no summary"
    except OSError:
        return "no log"

def write():
    doc = {"stage": stage, **(load(f"{work}/meta.json", {})),
           "elapsed_s": round(time.time() - float(os.environ["GS_T0"]), 1),
           "steps": [json.loads(ln) for ln in open(f"{work}/steps.jsonl")] if os.path.exists(f"{work}/steps.jsonl") else [],
           "bench": {os.path.basename(p)[6:-5]: load(p) for p in sorted(glob.glob(f"{work}/bench-*.json"))},
           **{os.path.basename(p)[6:-5]: load(p) for p in sorted(glob.glob(f"{work}/extra-*.json"))}}
    tmp = f"{out}/{stage}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, f"{out}/{stage}.json")
    return doc

def table():
    doc = write()
    dev = doc.get("device", {})
    total = f", {dev['total_bytes'] / 1e9:.1f} GB" if dev.get("total_bytes") else ""
    print(f"\n== {stage}{' (DRY RUN on the CPU: not GPU figures)' if doc.get('dry_run') else ''}: "
          f"{dev.get('name')}{total} (nvidia-smi: {dev.get('nvidia_smi') or '-'}); {doc['elapsed_s']:.0f} s of {doc.get('budget_s')} s")
    cpus = doc.get("cpus") or {}
    if cpus.get("os_cpu_count", 0) > cpus.get("affinity", 0) > 0:
        print(f"  CPUs: this process could use {cpus['affinity']} of {cpus['os_cpu_count']} (a cpuset)")
    for s in doc["steps"]:
        print(f"  step {s['name']:<18} rc {s['rc']:>3}  {s['wall_s']:>5.0f} s (limit {s['limit_s']})  {s.get('note', '')[:110]}")
    for name, b in doc["bench"].items():
        if not b:
            continue
        mem = b.get("gpu_memory") or {}
        if mem.get("rows_bytes"):
            margin = mem.get("margin_bytes")
            print(f"  {name}: rows allowed {mem['rows_bytes'] / 1e9:.1f} GB of the {mem.get('gpu')}'s "
                  f"{mem['gpu_total_bytes'] / 1e9:.1f} GB"
                  + (f" (an {mem['as_gpu']}'s: {mem['held_bytes'] / 1e9:.1f} GB held by a ballast)" if mem.get("applied") else "")
                  + (f"; offloadctl's device-tier margin {margin / 1e9:.1f} GB" if margin is not None else ""))
        for size, rows in (b.get("sizes") or {}).items():
            # Mid-size (cut short) a row is the list of its runs so far.
            rows = {n: (r[-1] if r else {"skipped": "not reached"}) if isinstance(r, list) else r for n, r in rows.items()}
            base = (rows.get("stock ZeRO-3 CPU offload", {}).get("iteration_s")
                    or rows.get("stock ZeRO-3 CPU offload, recorded", {}).get("iteration_s"))
            print(f"  {name} size {size}: {'row':<36} {'iter s':>8} {'vs CPU off':>10} {'GPU GB':>7} {'tier GB':>7}  device")
            for row, r in rows.items():
                if "iteration_s" in r:
                    vs = f"{base / r['iteration_s']:.2f}x" if base else "-"
                    tier = ((r.get("engine") or {}).get("fit") or {}).get("device_tier_bytes")
                    tier = f"{tier / 1e9:.1f}" if isinstance(tier, (int, float)) else "-"
                    print(f"    {row:<44} {r['iteration_s']:>8.3f} {vs:>10} {r['gpu_peak_reserved_bytes'] / 1e9:>7.1f} {tier:>7}  {r['device']}")
                else:
                    print(f"    {row:<44} {('failed: ' + r['failed']) if 'failed' in r else ('skipped: ' + r.get('skipped', '?'))}"[:150])
        for size, c in (b.get("checks") or {}).items():
            if "losses_vs_stock" in c:
                lv = c["losses_vs_stock"]
                for ref, rows in lv["by_reference"].items():
                    print(f"  losses 1-3 vs {ref} (rtol {lv['rtol']}): "
                          + ", ".join(f"{n} {v['max_rel_diff']:.1e} {'ok' if v['within'] else 'OVER'}" for n, v in rows.items()))
            if "tuner" in c:
                t = c["tuner"]
                print(f"  tuner: {json.dumps({k: t.get(k) for k in ('best_static', 'reached_at_iteration', 'met', 'final_device_fraction', 'note')})}")
    for key in ("node-bandwidth", "ops-archive", "disk"):
        if doc.get(key):
            print(f"  {key}: {json.dumps(doc[key])[:300]}")
    if doc.get("interrupted"):
        print(f"  INTERRUPTED: {doc['interrupted']['interrupted']}")

if sys.argv[1] == "step":  # name rc wall limit log [note]
    name, rc, wall, limit, log = sys.argv[2:7]
    note = sys.argv[7] if len(sys.argv) > 7 else ""
    if not note and name.endswith("tests"):
        note = pytest_summary(log)
    with open(f"{work}/steps.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "rc": int(rc), "wall_s": float(wall), "limit_s": limit, "log": os.path.basename(log),
                            "note": note}) + "\n")
    write()
elif sys.argv[1] == "write":
    write()
elif sys.argv[1] == "table":
    table()
EOF
export GS_WORK=$work GS_OUT=$out GS_STAGE=$stage GS_T0=$t0
emit() { python3 "$work/emit.py" "$@"; }

finish() {  # the JSON, the logs (reports dropped if over 15 MiB) and the table
  local size
  emit write
  tar -C "$work" -czf "$out/$stage-logs.tgz" logs $([ -d "$work/report" ] && echo report) 2>/dev/null
  size=$(stat -c %s "$out/$stage-logs.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 << 20)) ]; then
    echo "logs with reports: $((size >> 20)) MiB: the reports' HTML and PNGs left out"
    tar -C "$work" -czf "$out/$stage-logs.tgz" --exclude='*.html' --exclude='*.png' logs \
      $([ -d "$work/report" ] && echo report) 2>/dev/null
  fi
  emit table
  ls -la "$out"
}

on_signal() {
  trap '' TERM INT HUP
  echo "gpu_session: $1: stopping the running steps"
  kill_groups
  printf '{"interrupted": "%s at %s s"}\n' "$1" $(($(date +%s) - t0)) >"$work/extra-interrupted.json"
  finish
  rm -rf "$work"
  exit 143
}
trap 'on_signal TERM' TERM; trap 'on_signal INT' INT; trap 'on_signal HUP' HUP
trap 'rm -rf "$work"' EXIT

# run_step NAME LIMIT CMD...: CMD under `timeout` in its own group, output to logs/NAME.log, its limit
# the smaller of LIMIT and the time left; recorded in the JSON. Returns CMD's status (99: skipped).
run_step() {
  local name=$1 limit=$2 l s rc; shift 2
  l=$(($(left) + reserve - 5)); [ "$limit" -gt "$l" ] && limit=$l
  if [ "$limit" -lt 15 ]; then
    echo "-- $name: skipped, $l s left"; emit step "$name" 99 0 "$limit" /dev/null "skipped: $l s left"; return 99
  fi
  echo "-- $name (limit $limit s, $(($(date +%s) - t0)) s into the stage)"
  s=$(date +%s)
  timeout -k 10 "$limit" "$@" </dev/null >"$logs/$name.log" 2>&1 &
  local pid=$!; touch "$pgids/$pid"   # timeout leads its own process group: pgid = pid
  wait "$pid"; rc=$?
  rm -f "$pgids/$pid"
  tail -n 4 "$logs/$name.log" | cut -c1-200
  emit step "$name" "$rc" $(($(date +%s) - s)) "$limit" "$logs/$name.log"
  return "$rc"
}

# DeepSpeed's ops: each built in its own process (about 65 s each on a bare machine, in parallel),
# in the background; a no-op where env.sh unpacked .gpu/ops.tgz or they are built already.
ops_ready() { local e; e=$(ext_dir); ls "$e"/cpu_adam/*.so "$e"/async_io/*.so "$e"/offloadctl_host_fused/*.so >/dev/null 2>&1; }
ops_pids=()
build_ops_bg() {
  local op
  for op in cpu_adam async_io host_fused; do
    timeout -k 10 300 python3 -c 'import sys
from engine.storage.native_ops import build_ops
for s in build_ops((sys.argv[1],)).values(): print(f"native op {s.name}: {s.state} {s.detail}")' "$op" \
      </dev/null >"$logs/build-$op.log" 2>&1 &
    ops_pids+=($!); touch "$pgids/$!"
  done
}
wait_ops() {  # the rows need the ops: a row that finds them missing uses the slower fallbacks
  local pid s; s=$(date +%s)
  for pid in "${ops_pids[@]}"; do wait "$pid"; rm -f "$pgids/$pid"; done
  grep -h "native op" "$logs"/build-*.log 2>/dev/null | tail -4
  emit step ops-build "$(grep -l 'native op .*: built' "$logs"/build-*.log 2>/dev/null | wc -l | awk '{print ($1 == 3) ? 0 : 1}')" \
    $(($(date +%s) - s)) 300 /dev/null \
    "$(grep -h 'native op' "$logs"/build-*.log 2>/dev/null | tr '\n' ';' | cut -c1-300)"
}

odirect_dir() {  # the first candidate whose file system takes O_DIRECT (engine.storage.paths.check_usable)
  local d
  for d in /var/tmp /tmp "$root/.gpu/swap" "$HOME"; do
    mkdir -p "$d/offloadctl-swap" 2>/dev/null || continue
    if python3 -c "import sys; from engine.storage.paths import check_usable; check_usable(sys.argv[1])" \
         "$d/offloadctl-swap" 2>>"$logs/odirect.txt"; then
      findmnt -T "$d" >>"$logs/odirect.txt" 2>&1
      echo "$d/offloadctl-swap"; return 0
    fi
  done
  echo "no O_DIRECT directory found (see odirect.txt)" >&2; return 1
}

# pytest: on the GPU the selection runs; in the dry run it is only collected (it needs CUDA).
tests() {  # NAME LIMIT pytest args...
  local name=$1 limit=$2; shift 2
  if [ $dry = 1 ]; then
    run_step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider --collect-only "$@"
  else
    run_step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider --basetemp="$swap/pytest-$name" "$@"
  fi
}

# bench NAME SIZE [gpu_vs_stock options]: rows of bench/gpu_vs_stock.py, bounded by the stage's clock
# (less keep_s seconds, kept for a step after it).
bench() {
  local name=$1 size=$2 mr=$min_row; shift 2
  [ "$size" = 4b ] && mr=$min_row_4b
  run_step "bench-$name" "$budget" python3 bench/gpu_vs_stock.py --sizes "$size" --iters "$iters" \
    --stop-by $((t0 + budget - reserve - ${keep_s:-0})) --min-row-s "$mr" --row-timeout "$row_cap" --gpu-memory-as auto \
    --json "$work/bench-$name.json" --logs "$logs/rows" "$@"
}

# -- the stage's facts, first: what ran where
nvidia-smi -L >"$logs/gpu.txt" 2>&1 || echo "no nvidia-smi" >"$logs/gpu.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$logs/gpu-query.txt" 2>&1 \
  || echo "no nvidia-smi" >"$logs/gpu-query.txt"
python3 - "$work/meta.json" "$dry" "$budget" "$logs/gpu.txt" "$logs/gpu-query.txt" "$ncpu" "$naff" <<'EOF' 2>>"$logs/meta.err"
import json, sys, torch
dst, dry, budget = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
smi, query = (open(f).read().strip() for f in sys.argv[4:6])
cuda = torch.cuda.is_available()
total = torch.cuda.get_device_properties(0).total_memory if cuda else None
json.dump({"dry_run": dry, "budget_s": budget, "torch": torch.__version__,
           "cpus": {"os_cpu_count": int(sys.argv[6]), "affinity": int(sys.argv[7])},
           "device": {"name": torch.cuda.get_device_name() if cuda else "cpu", "nvidia_smi_L": smi if cuda else None,
                      "nvidia_smi": query if cuda else None, "total_bytes": total,
                      "bench_gpu_memory": ("the bench rows are allowed an H100 80GB's memory (a ballast holds the rest; "
                                           "offloadctl's device-tier margin taken from it): bench.*.gpu_memory"
                                           if total and total > 100e9 else "the bench rows have the whole card")}},
          open(dst, "w"), indent=1)
EOF
if [ $dry = 0 ] && ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "gpu_session: no CUDA here (for a dry run on a CPU machine: GPU_SESSION_SIZE=cpu)"
  emit step cuda 1 0 0 /dev/null "no CUDA"; finish; exit 1
fi
swap=$(odirect_dir) || { emit step odirect 1 0 0 /dev/null "no O_DIRECT directory"; finish; exit 1; }
if [ $cpuset = 1 ]; then  # before the op builds, which would take the cores it measures with
  run_step node-bandwidth 60 python3 -c 'import json, os, sys, torch
from engine.gpumem import measure_memory_bandwidth
from engine.host_kernel import keep_node_memory_bandwidth, node_memory_bandwidth
cpus = os.sched_getaffinity(0)
torch.set_num_threads(len(cpus))
bw = getattr(measure_memory_bandwidth, "__wrapped__", measure_memory_bandwidth)()
keep_node_memory_bandwidth(bw)
kept = node_memory_bandwidth(measure=False)
json.dump({"cpuset": True, "os_cpu_count": os.cpu_count(), "affinity": len(cpus), "node_bandwidth_bytes_per_s": bw,
           "kept": kept == bw}, open(sys.argv[1], "w"))
print(f"node memory bandwidth {bw / 1e9:.1f} GB/s on the {len(cpus)} CPUs this process may use, kept for the rows: {kept == bw}")' \
    "$work/extra-node-bandwidth.json" \
    || echo "gpu_session: the node bandwidth could not be kept: offloadctl's first step may probe it (see node-bandwidth.log)"
fi
had_ops=0; ops_ready && had_ops=1
echo "gpu_session $stage: $(head -1 "$logs/gpu.txt"), budget $budget s, swap $swap, ops built at start: $had_ops"
build_ops_bg

case "$stage" in
  stage1)
    # The CUDA tests while the ops build: numerics on CUDA, the GPU path's ordering, events, lane
    # memory, and the GPU path through DeepSpeed (one launch: offload_states/reload_states refit).
    # By name: the @needs_cuda tests alone (the CPU fakes beside them ran in the suite already; a
    # -k on "cuda or flat or gpu_path" re-ran every one of them, issue 47).
    tests cuda-tests 150 \
      tests/test_gpu_path.py::test_cuda_weights_are_ready_on_the_current_stream \
      tests/test_gpu_path.py::test_cuda_event_waits_sleep \
      tests/test_gpu_path.py::test_cuda_lane_memory_is_its_slots \
      tests/test_gpu_path.py::test_cuda_lane_rates_leave_the_generators_alone \
      tests/test_gpu_path.py::test_cuda_refit_after_release_measures_the_training_peak \
      tests/test_gpu_path.py::test_cuda_an_eval_pass_into_the_margin_moves_the_tier_off \
      tests/test_numerics.py::test_cuda_layouts_match_adamw \
      tests/test_numerics.py::test_cuda_knob_switches_match_adamw \
      tests/test_numerics.py::test_flat_bf16_binding_with_grad_scale_on_cuda \
      tests/test_gpu_path_ds.py::test_cuda_offload_and_reload_states_refit_as_at_the_first_step
    wait_ops
    # The headline second, not fifth: time is kept for stock (--required 2, min_row_4b). The ops are
    # archived after both (the host-kernel choice our row made is in the archive), never in stock's time.
    bench headline "$big" --profile none --required 2 \
      --row "offloadctl default" --row "stock ZeRO-3 CPU offload" \
      --row "offloadctl fraction 1" --row "stock Twin-Flow ratio 0.7" \
      --after-required "bash bench/gpu_session.sh pack-ops '$out' '$work'"
    ;;
  stage2)
    wait_ops   # the profile times the host AdamW kernels and the I/O backend: not beside a build
    if run_step profile 150 offloadctl profile save gpu-session --quick --nvme "$swap" --output "$work/profile.toml" --force \
        && [ -f "$work/profile.toml" ]; then
      cp "$work/profile.toml" "$out/profile.toml"; prof=$work/profile.toml
      echo "bring back: profile.toml -> .gpu/profile.toml"
    else
      prof=none
    fi
    # The host lane at the node's thread counts (issue 47 items 1 and 2): its rate per thread against
    # the copy bandwidth, and each kernel's lane (torch's in per-thread parts, cpu_adam's driven by one
    # thread: its op holds the interpreter lock) beside stock's step, quiet and with 2 busy processes.
    run_step host-lane-threads 45 python3 bench/host_lane_threads.py --threads 1 4 8 16 --rounds 3
    run_step host-lane-kernels 60 python3 bench/host_lane_step.py 3 --threads 8 16 --busy 0 2
    mkdir -p "$work/report"
    bench calibration "$big" --profile "$prof" --required 2 --report "$work/report" \
      --row "offloadctl default" --row "stock ZeRO-3 CPU offload, recorded" \
      --row "offloadctl fraction 0" --row "offloadctl fraction 0.5" --row "stock Twin-Flow ratio 0.5"
    ;;
  stage3)
    # DeepSpeed rows on one GPU: the NVMe tier, the lane's bookkeeping, and the GPU default.
    tests ds-tests 200 tests/test_deepspeed_integration.py -k "1rank-fp32 or 1rank-bf16 or lane-on-cpu-bf16 or gpu_default"
    wait_ops
    bench fits "$mid" --profile none --required 3 \
      --row "offloadctl default" --row "stock, no offload" --row "stock ZeRO-3 CPU offload" \
      --row "stock Twin-Flow ratio 0.3" --row "stock Twin-Flow ratio 0.1" --row "stock Twin-Flow ratio 0.5"
    ;;
  stage4)
    # The disk first: ZeRO-Infinity swaps 16 B a parameter (fp32 master, moments, gradients) and
    # moves about 32 B a parameter a step; the size is the largest whose swap fits 85% of the free
    # space and whose ZeRO-Infinity step would take at most 30 s at the measured rates.
    cat >"$work/disk.py" <<'EOF'
import json, mmap, os, sys, time
d, dst, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
st = os.statvfs(d); free = st.f_bavail * st.f_frsize
path, chunk, n = os.path.join(d, "probe.bin"), 8 << 20, 128 if not dry else 16
buf = mmap.mmap(-1, chunk); buf.write(os.urandom(chunk))
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
t = time.perf_counter()
for _ in range(n):
    os.write(fd, buf)
os.fsync(fd); os.close(fd); w = n * chunk / (time.perf_counter() - t)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
t = time.perf_counter()
while os.readv(fd, [buf]) > 0:
    pass
os.close(fd); r = n * chunk / (time.perf_counter() - t); os.unlink(path)
params = {"4b": 3.93e9, "2b": 2.06e9, "1b": 0.94e9}
rate = min(r, w)
fits = {s: {"swap_bytes": 16 * p, "zi_step_s_est": 32 * p / rate} for s, p in params.items()}
pick = next((s for s, f in fits.items() if f["swap_bytes"] <= 0.85 * free and f["zi_step_s_est"] <= 30), "1b")
out = {"dir": d, "free_bytes": free, "write_bytes_per_s": w, "read_bytes_per_s": r, "probe_bytes": n * chunk,
       "sizes": fits, "size": "cpu" if dry else pick}
json.dump(out, open(dst, "w"), indent=1)
print(f"disk: {free / 1e9:.0f} GB free, write {w / 1e9:.2f} GB/s, read {r / 1e9:.2f} GB/s: size {out['size']}")
EOF
    run_step disk 60 python3 "$work/disk.py" "$swap" "$work/extra-disk.json" "$dry"
    nsize=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["size"])' "$work/extra-disk.json" 2>/dev/null \
            || echo "$([ $dry = 1 ] && echo cpu || echo 1b)")
    wait_ops
    # The demo after it is kept 100 s (about 30 steps of a small model and its report).
    keep_s=$([ $dry = 1 ] && echo 40 || echo 100) bench nvme "$nsize" --profile none --required 2 --nvme "$swap/bench" --zi-aio "$zi_aio" \
      --row "offloadctl nvme, device cache 0" --row "stock ZeRO-Infinity"
    # `make demo` as shipped, with the device's python (no venv there, and no network).
    demo=$work/report/demo-run; mkdir -p "$swap/demo" "$work/report"
    run_step demo 150 offloadctl train --num_gpus 1 --nvme "$swap/demo" --run-dir "$demo" examples/train_gpt.py \
      --steps "$([ $dry = 1 ] && echo 3 || echo 30)" \
      && run_step demo-report 60 offloadctl report "$demo" --output "$work/report/demo-report.html"
    rm -rf "$swap/demo"
    bench nvme-default "$nsize" --profile none --nvme "$swap/bench" --row "offloadctl nvme"
    ;;
  stage5)
    tuned_bench() {
      bench tuner "$mid" --profile none --required 2 --tuner-iters "$([ $dry = 1 ] && echo 6 || echo 35)" \
        --row "offloadctl tuned from fraction 0" --row "offloadctl fraction 0.5" \
        --row "offloadctl fraction 1" --row "offloadctl fraction 0"
    }
    rlhf_tests() {
      tests rlhf-tests 180 tests/test_ds_interop.py tests/test_deepspeed_integration.py \
        -k "offload_and_reload_states or checkpoint_resume or device-tiers"
    }
    # The tuner is this stage's point; the tests take the build's time when there is a build.
    if [ $had_ops = 1 ]; then wait_ops; tuned_bench; rlhf_tests; else rlhf_tests; wait_ops; tuned_bench; fi
    ;;
esac
# Later stages bring back the ops they had to build (stage 1 after its required rows, or here when
# those took the stage's time).
if [ $had_ops = 0 ] && [ ! -f "$out/ops.tgz" ] && ops_ready; then pack_ops "$out" "$work"; fi
finish
