"""Golden outputs of the performance model, to show that a refactor of ``perf/`` changes nothing.

Evaluates ``predict`` (a fixed set of plans), ``best_plan``, ``alternatives`` and
``stock_deepspeed`` (every kind) over a grid: every profile in ``profiles/*.toml`` and the
hand-built profiles the tests use, model sizes 1e8..1e11, 1, 2 and 8 ranks per node, 1 and 2
nodes, with and without ``paths``, ``host_bytes`` and ``gpu_headroom_bytes``. Errors
(``ConfigError``) are outputs too, by message. Floats are rounded to 1e-9 relative.

    .venv/bin/python bench/model_golden.py --write before.json      # before the change
    .venv/bin/python bench/model_golden.py --check before.json      # after: exit 1 on any difference

Plans are built through :func:`make_plan` from flat keys, so the script runs against a ``Plan``
with its knobs as fields or as a nested ``Knobs``. Each prediction is recorded twice: flat (the
plan's placement and knobs, the times, breakdown, memory, notes) and as ``Prediction.to_dict()``
(what ``offloadctl plan --json`` prints). It runs with ``PYTHONHASHSEED=0`` (re-executing itself):
the bottleneck of two chains that tie is named by set order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import Knobs  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from perf import model  # noqa: E402
from perf.profile import SCHEMA_VERSION, AdamWRate, Figure, Gpu, Host, Machine, PathProfile, Profile, Source, SweepPoint  # noqa: E402
from perf.profile_toml import load_profile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOB_NAMES = ("device_fraction", "prefetch_depth", "io_concurrency", "node_lock", "stripe_weights")

# The model's public functions, wherever the refactor puts them (perf.model re-exports or not).
try:
    from perf.search import alternatives, best_plan  # type: ignore[import-not-found]
except ImportError:
    alternatives, best_plan = model.alternatives, model.best_plan
try:
    from perf.stock import STOCK_KINDS, stock_deepspeed  # type: ignore[import-not-found]
except ImportError:
    STOCK_KINDS, stock_deepspeed = model.STOCK_KINDS, model.stock_deepspeed
Plan, Workload, predict = model.Plan, model.Workload, model.predict


def make_plan(*, name: str = "", host_cache_bytes=None, device_cache_bytes: int = 0, **knobs):
    if "knobs" in Plan.__dataclass_fields__:
        return Plan(host_cache_bytes=host_cache_bytes, device_cache_bytes=device_cache_bytes, knobs=Knobs(**knobs), name=name)
    return Plan(host_cache_bytes=host_cache_bytes, device_cache_bytes=device_cache_bytes, name=name, **knobs)


def flat_plan(plan) -> dict:
    k = getattr(plan, "knobs", plan)
    return {
        "name": plan.name,
        "host_cache_bytes": plan.host_cache_bytes,
        "device_cache_bytes": plan.device_cache_bytes,
        **{n: getattr(k, n) for n in KNOB_NAMES},
    }


# -- profiles -------------------------------------------------------------------------------------


def fig(v: float) -> Figure:
    return Figure(value=float(v), how="hand-set", when="2026-01-01T00:00:00Z")


def disk(path, device, read=400e6, write=400e6, mixed=800e6, capacity=10**13, sweep=(), device_id=None) -> PathProfile:
    return PathProfile(
        path=path,
        kind="nvme",
        device=device,
        device_id=device_id or f"id-{device}",
        capacity_bytes=capacity,
        read_bytes_per_s=fig(read),
        write_bytes_per_s=fig(write),
        mixed_bytes_per_s=fig(mixed),
        best_concurrency=4,
        sweep=tuple(sweep),
    )


def gpu(h2d=10e9, duplex=8e9, adamw=1e11, memory=80 << 30) -> Gpu:
    return Gpu(
        model="test GPU",
        memory_bytes=memory,
        h2d_bytes_per_s=fig(h2d),
        d2h_bytes_per_s=fig(h2d),
        duplex_h2d_bytes_per_s=fig(duplex),
        duplex_d2h_bytes_per_s=fig(duplex),
        adamw_params_per_s=fig(adamw),
    )


def machine(name, paths=(), *, cpu=1e9, mem=10e9, cores=2, memory=24 << 30, g=None, gpus=0, lane=None) -> Profile:
    host = Host(memory_bandwidth=fig(mem), adamw=(AdamWRate(threads=cores, params_per_s=fig(cpu)),))
    if lane is not None:
        import dataclasses

        host = dataclasses.replace(host, host_lane_params_per_s=fig(lane))
    return Profile(
        schema_version=SCHEMA_VERSION,
        name=name,
        source=Source(kind="estimate", description="hand-set"),
        machine=Machine(
            hostname="test",
            cpu_model="test",
            cores_physical=cores,
            cores_logical=cores,
            memory_bytes=memory,
            numa_nodes=1,
            gpu_model=g.model if g else "",
            gpu_count=gpus,
        ),
        host=host,
        paths=tuple(paths),
        gpu=g,
    )


def profiles() -> list[Profile]:
    out = [
        load_profile(os.path.join(ROOT, "profiles", f))
        for f in sorted(os.listdir(os.path.join(ROOT, "profiles")))
        if f.endswith(".toml")
    ]
    sweep = [
        SweepPoint(op=op, concurrency=c, block_bytes=8 << 20, bytes_per_s=fig(k * 100e6 * c))
        for c in (1, 2, 4, 8)
        for op, k in (("read", 1), ("write", 1), ("mixed", 2))
    ]
    sweep2 = sweep + [
        SweepPoint(op=op, concurrency=c, block_bytes=1 << 20, bytes_per_s=fig(k * 60e6 * c))
        for c in (1, 4, 16)
        for op, k in (("read", 1), ("write", 1.5), ("mixed", 2))
    ]
    out += [
        machine("one-disk", [disk("/nvme", "nvme0n1")]),
        machine("two-disks", [disk("/nvme0", "nvme0n1"), disk("/nvme1", "nvme1n1", read=200e6, write=200e6, mixed=400e6)]),
        machine("one-device-two-paths", [disk("/nvme/a", "nvme0n1"), disk("/nvme/b", "nvme0n1", device_id="259:2")]),
        machine("sweep", [disk("/nvme", "nvme0n1", sweep=sweep), disk("/scratch", "sdb", sweep=sweep2, capacity=5 * 10**11)]),
        machine("gpu-slow-cpu", [disk("/nvme", "nvme0n1")], cpu=1e8, g=gpu(h2d=25e9, duplex=20e9), gpus=1),
        machine("gpu-no-disk", cpu=1e9, g=gpu(adamw=1e10, memory=24 << 30), gpus=2),
        machine("no-gpu-no-disk", memory=1 << 30),
        machine(
            "big",
            [disk("/nvme0", "nvme0n1", capacity=10**15), disk("/nvme1", "nvme1n1", capacity=10**15)],
            cpu=4e9,
            mem=200e9,
            cores=64,
            memory=2 << 40,
            g=gpu(),
            gpus=8,
            lane=2e9,
        ),
        machine("small-disk", [disk("/nvme", "nvme0n1", capacity=10**10)], memory=8 << 30, g=gpu(memory=16 << 30), gpus=8),
    ]
    return out


# -- evaluation -----------------------------------------------------------------------------------


def rounded(x):
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if not math.isfinite(x) or x == 0 else float(f"{x:.9e}")
    if isinstance(x, dict):
        return {str(k): rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return repr(x)


def exact_floats(x):
    """Every float as its repr (all its bits), for the exact comparison."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, dict):
        return {str(k): exact_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [exact_floats(v) for v in x]
    return x


def jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return f"float:{x}"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [jsonable(v) for v in x]
    return x


def pred_out(p) -> dict:
    return {
        "plan": flat_plan(p.plan),
        "update_s": p.update_s,
        "iteration_s": p.iteration_s,
        "breakdown": p.breakdown,
        "bytes_per_param": p.bytes_per_param,
        "bottleneck": p.bottleneck,
        "notes": list(p.notes),
        "feasible": p.feasible,
        "memory": p.memory,
        "to_dict": p.to_dict(),
    }


def call(f, *a, **kw):
    try:
        r = f(*a, **kw)
    except ConfigError as e:
        return {"error": str(e)}
    return [pred_out(p) for p in r] if isinstance(r, list) else pred_out(r)


def fixed_plans(prof: Profile) -> list:
    names = [p.path for p in prof.paths]
    one = {"io_concurrency": {names[0]: 8}} if names else {}
    plans = [
        make_plan(name="host only", host_cache_bytes=None),
        make_plan(name="defaults"),
        make_plan(name="nvme d0", host_cache_bytes=0, prefetch_depth=0, **one),
        make_plan(name="nvme d2", host_cache_bytes=0, prefetch_depth=2, **one),
        make_plan(name="nvme d4 lock", host_cache_bytes=0, prefetch_depth=4, node_lock=True, **one),
        make_plan(name="half cached", host_cache_bytes=2_000_000_000, prefetch_depth=1),
        make_plan(name="lane", host_cache_bytes=None, device_fraction=0.5),
        make_plan(name="lane swapped", host_cache_bytes=0, device_fraction=0.25, prefetch_depth=3),
        make_plan(name="device cache", host_cache_bytes=1_000_000_000, device_cache_bytes=3_000_000_000, device_fraction=0.1),
        make_plan(name="unknown path", host_cache_bytes=0, stripe_weights={"/elsewhere": 1.0}),
    ]
    if names:
        plans.append(
            make_plan(
                name="weighted",
                host_cache_bytes=0,
                prefetch_depth=2,
                io_concurrency={n: 1 + 3 * i for i, n in enumerate(names)},
                stripe_weights={n: float(i + 1) for i, n in enumerate(names)},
            )
        )
        plans.append(make_plan(name="zero weights", host_cache_bytes=0, stripe_weights={n: 0.0 for n in names}))
    return plans


def grid(quick: bool = False):
    for prof in profiles():
        names = [p.path for p in prof.paths]
        variants = [("plain", {}, None)]
        if names:
            variants.append(("first path", {}, names[:1]))
        variants += [
            ("host 8 GB", {"host_bytes": 8 * 10**9}, None),
            ("headroom 6 GB", {"gpu_headroom_bytes": 6 * 10**9}, None),
            (
                "all",
                {"host_bytes": 64 * 10**9, "gpu_headroom_bytes": 20 * 10**9, "fwd_bwd_s": 2.5},
                names[-1:] if names else None,
            ),
        ]
        for params in (1e8, 1e10) if quick else (1e8, 1e9, 1e10, 1e11):
            for ranks in (1, 2, 8):
                for nodes in (1, 2):
                    for vname, extra, paths in variants:
                        yield prof, vname, Workload(params=int(params), ranks=ranks, nodes=nodes, **extra), paths


def run(quick: bool = False) -> dict:
    out = {}
    for prof, vname, wl, paths in grid(quick):
        key = f"{prof.name}|{wl.params:.0e}|r{wl.ranks}|n{wl.nodes}|{vname}"
        row = {
            "best_plan": call(best_plan, prof, wl, paths),
            "best_plan_no_device_cache": call(best_plan, prof, wl, paths, device_cache=False),
            "alternatives": call(alternatives, prof, wl, paths),
            "stock": {k: call(stock_deepspeed, prof, wl, k) for k in STOCK_KINDS},
            "predict": {pl.name: call(predict, prof, wl, pl) for pl in fixed_plans(prof)},
        }
        if vname == "plain":
            row["twinflow_ratios"] = {str(r): call(stock_deepspeed, prof, wl, "twinflow", ratio=r) for r in (0.0, 0.5, 1.0)}
        out[key] = row
    return out


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # A tie between two chains names the bottleneck by set order, which follows the string
        # hash: fix the seed so that two runs compare.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    ap.add_argument("--quick", action="store_true", help="two model sizes instead of four")
    args = ap.parse_args()
    t0 = time.perf_counter()
    raw = run(args.quick)
    exact = hashlib.sha256(json.dumps(jsonable(exact_floats(raw)), sort_keys=True).encode()).hexdigest()
    data = {"exact_sha256": exact, "rows": jsonable(rounded(raw))}
    print(f"{len(raw)} grid points in {time.perf_counter() - t0:.1f} s; exact sha256 {exact[:16]}")
    if args.write:
        with open(args.write, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        return 0
    with open(args.check) as f:
        want = json.load(f)
    got = json.loads(json.dumps(data, sort_keys=True))
    bad = [k for k in want["rows"] if got["rows"].get(k) != want["rows"][k]]
    bad += [k for k in got["rows"] if k not in want["rows"]]
    print(
        f"rounded (1e-9 relative): {'identical' if not bad else f'{len(bad)} grid points differ'}; "
        f"every float to the last bit: {'identical' if exact == want['exact_sha256'] else 'differs'}"
    )
    for k in bad[:5]:
        print("differs:", k)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
