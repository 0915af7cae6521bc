"""No lock-in: DeepSpeed's documented APIs work with the engine in place, and checkpoints move
between stock DeepSpeed and offloadctl both ways, on real DeepSpeed runs (CPU accelerator, gloo).

Every comparison is against stock DeepSpeed running the same script with the same seed. The
runs that save checkpoints, and the stock references, come from the session's cache (ds_runs.py):
a test that changes a checkpoint works on its own copy.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from ds_runs import (
    LAYOUTS,
    SAVE,
    STATE_API,
    TINY,
    UNIVERSAL,
    Checkpoint,
    baseline,
    launch,
    ours,
    resumed_stock,
    stock,
    to_universal,
)
from helpers import ROOT, cli, env_with_root, free_port

pytestmark = pytest.mark.slow

TWO_PATHS = "two-paths"


def _read_values(run, ranks: int) -> list[dict]:
    return [torch.load(f"{run.dir}/values.pt.rank{r}") for r in range(ranks)]


def _saver(who: str, ranks: int, dtype: str, layout: str | None = None):
    """The run that saves at step 3: stock's reference run, or ours with the state on ``layout``."""
    return baseline(ranks, dtype) if who == "stock" else ours(ranks, "--dtype", dtype, *SAVE, opts=LAYOUTS[layout])


def _loader(who: str, ranks: int, dtype: str, layout: str | None, ckpt: str, *extra: str):
    resume = ("--dtype", dtype, "--resume", ckpt, *extra)
    return stock(ranks, *resume) if who == "stock" else ours(ranks, *resume, opts=LAYOUTS[layout])


@pytest.mark.parametrize(
    "ranks,dtype,layout", [(1, "fp32", "all-nvme"), (2, "bf16", "nvme-and-host"), (1, "bf16", "lane-on-cpu")]
)
def test_partitioned_state_api_matches_stock(ranks, dtype, layout, ds_runs):
    """deepspeed.utils.safe_get_*/safe_set_* and safe_update_full_grad_vectorized ("Debugging"
    and "Modifying Partitioned States" in DeepSpeed's ZeRO-3 docs), with gradient clipping: every
    value read at step 2 equals stock's, and the losses after the writes at step 3 do too. A
    subgroup on NVMe is read from and written to its swap file."""
    api = ("--dtype", dtype, *STATE_API)
    a = ds_runs.reference(stock(ranks, *api)).ok()
    b = ds_runs.get(ours(ranks, *api, opts=LAYOUTS[layout])).ok()
    for ref, got in zip(_read_values(a, ranks), _read_values(b, ranks)):
        assert ref.keys() == got.keys() and len(ref) == 48  # 6 parameters x 8 getters
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(b.losses), torch.tensor(a.losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["all-nvme", "lane-on-cpu"])
def test_module_only_load_of_a_stock_checkpoint_matches_stock(layout, ds_runs):
    """load_checkpoint(load_optimizer_states=False, load_module_only=True), fine-tuning from a
    checkpoint: the masters come from the loaded weights, as in stock. The checkpoint is stock's."""
    want = ds_runs.reference(resumed_stock(1, "fp32", 1, "--resume-module-only")).ok().losses
    got = (
        ds_runs.get(
            ours(
                1,
                "--dtype",
                "fp32",
                "--resume",
                "{ckpt}",
                "--resume-module-only",
                opts=LAYOUTS[layout],
                ckpt=Checkpoint(baseline(1, "fp32")),
            )
        )
        .ok()
        .losses
    )
    assert len(got) == len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


# -- checkpoints, both ways ------------------------------------------------------------------------

STOCK_RTOL = {"fp32": 1e-5, "bf16": 2e-3}
"""Losses against stock's: the host lane's kernel (torch's fused AdamW or DeepSpeedCPUAdam, the
faster here, engine.host_kernel) rounds the fp32 master differently in the last bit from stock's
DeepSpeedCPUAdam; in bf16 that can flip a weight's last of 8 mantissa bits (2^-8 = 0.4%), and a
loss moves by a small share of that. Resumed against uninterrupted runs of the same engine and
kernel, every dtype is held to 1e-5."""


@pytest.mark.parametrize(
    "saver,loader,ranks,dtype",
    [
        (("stock", None), ("ours", "all-nvme"), 2, "fp32"),
        (("stock", None), ("ours", TWO_PATHS), 1, "bf16"),
        (("ours", "nvme-and-host"), ("stock", None), 2, "bf16"),
        (("ours", "all-nvme"), ("ours", TWO_PATHS), 2, "fp32"),
        (("ours", TWO_PATHS), ("ours", "lane-on-cpu"), 1, "bf16"),
        (("ours", "all-host"), ("ours", "all-nvme"), 1, "fp32"),
    ],
    ids=[
        "stock-to-ours-2ranks-fp32",
        "stock-to-ours-two-paths-bf16",
        "ours-to-stock-2ranks-bf16",
        "ours-to-ours-other-paths-2ranks",
        "ours-to-ours-device-tiers-bf16",
        "ours-host-to-ours-nvme",
    ],
)
def test_checkpoints_move_both_ways(saver, loader, ranks, dtype, ds_runs, tmp_path):
    """A checkpoint saved at step 3 (gradient clipping on) and resumed by the other side, or by
    offloadctl with another tier layout, continues with the losses of the uninterrupted run. The
    loading run never sees the saving run's tiers."""
    full = ds_runs.get(_saver(saver[0], ranks, dtype, saver[1])).ok()
    resumed = launch(_loader(loader[0], ranks, dtype, loader[1], str(full.dir / "ckpt")), tmp_path).ok()
    assert len(full.losses) == 6 and len(resumed.losses) == 3
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[3:]), rtol=1e-5, atol=0)
    if saver[0] == "ours":  # the uninterrupted run itself is stock's
        ref = ds_runs.get(baseline(ranks, dtype)).ok()
        torch.testing.assert_close(torch.tensor(full.losses), torch.tensor(ref.losses), rtol=STOCK_RTOL[dtype], atol=0)


def test_zero_to_fp32_reads_our_checkpoint_as_stocks(ds_runs):
    """DeepSpeed's zero_to_fp32 on offloadctl's checkpoint gives the weights it gives on stock's.
    (The checkpoint is the one stock resumes from in test_checkpoints_move_both_ways: the files'
    format does not depend on the tiers the state lived on.)"""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ref, got = (
        get_fp32_state_dict_from_zero_checkpoint(str(ds_runs.get(_saver(who, 2, "bf16", layout)).ok().dir / "ckpt"), tag="ckpt")
        for who, layout in (("stock", None), ("ours", "nvme-and-host"))
    )
    assert ref.keys() == got.keys() and len(ref) == 6
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("saved_ranks,loaded_ranks", [(2, 1), (1, 2)])
def test_universal_checkpoint_of_ours_resumes_at_another_rank_count(saved_ranks, loaded_ranks, ds_runs, tmp_path):
    """DeepSpeed's universal checkpoint (ds_to_universal) made from offloadctl's checkpoint resumes
    at a different number of ranks, under offloadctl (other tiers) and under stock, as stock's own
    universal checkpoint does. (At another rank count the data per step differs, so the reference
    is stock resuming from stock's universal checkpoint, not the uninterrupted run.)"""
    ref = ds_runs.reference(resumed_stock(loaded_ranks, "fp32", saved_ranks, universal=True)).ok()
    # Converted in a copy: the save is shared.
    ckpt = ds_runs.get(_saver("ours", saved_ranks, "fp32", "all-nvme")).ok().copy_of("ckpt", tmp_path / "ours")
    to_universal(ckpt)
    stock_from_ours = launch(_loader("stock", loaded_ranks, "fp32", None, ckpt, *UNIVERSAL), tmp_path / "r2").ok()
    ours_from_ours = launch(_loader("ours", loaded_ranks, "fp32", TWO_PATHS, ckpt, *UNIVERSAL), tmp_path / "r3").ok()
    assert len(ref.losses) == 3
    for got in (stock_from_ours, ours_from_ours):
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)


# -- checkpoints that do not load ----------------------------------------------------------------


def _saved(ds_runs, tmp_path, ranks: int) -> str:
    """A copy of the checkpoint offloadctl saved at step 3 (fp32, state on NVMe) with ``ranks``
    ranks, for a test that damages it."""
    run = ds_runs.get(_saver("ours", ranks, "fp32", "all-nvme")).ok()
    return run.copy_of("ckpt", tmp_path / "ckpt")


def _damage(kind: str, ckpt: str) -> None:
    optim = sorted(glob.glob(os.path.join(ckpt, "ckpt", "*optim_states.pt")))
    if kind == "truncated":
        with open(optim[0], "r+b") as f:
            f.truncate(os.path.getsize(optim[0]) // 2)
    elif kind == "missing-rank-file":
        os.unlink(optim[-1])


@pytest.mark.parametrize(
    "kind,ranks,load_ranks,extra,expect",
    [
        (
            "another-model",
            1,
            1,
            ("--hidden", "48"),
            "holds another model: 0.weight is torch.Size([64, 32]) there and torch.Size([48, 32]) here",
        ),
        ("missing-rank-file", 2, 2, (), "lacks"),
        ("truncated", 1, 1, (), "is truncated or damaged"),
        ("rank-count", 2, 1, (), "was saved by 2 ranks and this run has 1"),
        ("other-subgroups", 1, 1, ("--sub-group-size", "50"), "subgroups of"),
    ],
)
def test_a_checkpoint_that_does_not_load_is_one_line(kind, ranks, load_ranks, extra, expect, ds_runs, tmp_path):
    """One line naming the checkpoint file or directory, what differs and the fix; no traceback."""
    ckpt = _saved(ds_runs, tmp_path, ranks)
    _damage(kind, ckpt)
    p = launch(ours(load_ranks, "--resume", ckpt, *extra, opts=LAYOUTS["all-nvme"]), tmp_path / "load")
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("offloadctl: ") and expect in line and str(tmp_path / "ckpt") in line or "subgroups" in line, line
    assert "Traceback" not in p.stderr


def test_a_failed_load_leaves_the_tiers_alone(ds_runs, tmp_path):
    """A script that catches the failure and goes on finds the optimizer's state as it was, on
    every tier: the subgroup check comes before anything is written."""
    ckpt = _saved(ds_runs, tmp_path, 1)
    out = tmp_path / "try.json"
    launch(
        ours(1, "--dtype", "fp32", "--resume", ckpt, "--try-resume", str(out), "--sub-group-size", "50"), tmp_path / "goes-on"
    ).ok()
    got = json.loads(out.read_text())
    assert got["outcome"].startswith("failed: the checkpoint's optimizer state has") and got["tiers_unchanged"], got


# -- launching: two nodes, each launched on its own --------------------------------------------------


def test_two_nodes_launched_per_node_match_stock(ds_runs, tmp_path):
    """Two per-node launches (--no_ssh --node_rank 0|1, one hostfile naming both nodes, one master
    address), as on a cluster without ssh between nodes (Kubernetes, a Slurm step per node). Each
    "node" has its own NVMe path, run dir and tuner daemon; losses equal stock DeepSpeed's with two
    ranks (the script's data and model depend on the rank and the world size, not on which node a
    rank runs on: the session's stock run of two ranks is the reference); each node's telemetry and
    report are complete."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port, procs = free_port(), []
    for node in (0, 1):
        d = tmp_path / f"ours{node}"
        (d / "nvme").mkdir(parents=True)
        per_node = [
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
        ]
        cmd = [
            sys.executable,
            "-m",
            "offloadctl.cli",
            "train",
            *per_node,
            "--nvme",
            str(d / "nvme"),
            "--host-cache",
            "0",
            "--run-dir",
            str(d / "run"),
            TINY,
            "--losses-out",
            str(d / "losses.jsonl"),
        ]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_with_root(), cwd=ROOT)
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    ref = ds_runs.get(baseline(2, "fp32")).ok()
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "ours0")), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for node in (0, 1):
        run = tmp_path / f"ours{node}" / "run"
        recs = [json.loads(line) for line in open(run / f"telemetry-rank{node}.jsonl")]  # node N runs rank N
        # Written to its own path (this model's swapped state fits the staging buffers, so it is not read back).
        assert len(recs) == 6 and sum(r["bytes_written"].get("nvme", 0) for r in recs) > 0
        assert "tuner" in outs[node] and (run / "tuner").is_dir()  # its own daemon
        p = cli("report", str(run), "--output", str(run / "report.html"), timeout=300)
        assert p.returncode == 0 and (run / "report.html").stat().st_size > 10_000, p.stderr[-2000:]


OFFLOAD_GAP_S = 1.0
"""Seconds between offload_states and reload_states (the generation) in the runs below."""
GENERATING = os.path.join(ROOT, "tests", "ds_scripts", "train_tiny_generating.py")


@pytest.mark.parametrize(
    "include,layout",
    [
        ("all", "lane-on-cpu"),
        ("optim_states,hp_params", "all-nvme"),
        ("lp_params,lp_grads,contiguous_grad_buffer", "nvme-and-host"),
    ],
)
def test_offload_and_reload_states_keep_training_exact(include, layout, ds_runs):
    """engine.offload_states()/reload_states() (RLHF frameworks, around generation) after step 3:
    the state DeepSpeed's API reads is the same before and after (checked in the script), and
    training continues with stock's losses (stock runs without them: with CPU offload its own
    offload_states takes only the 16-bit states, so there is nothing to compare it with). The
    gap between them (OFFLOAD_GAP_S: the generation) is no part of the next step's time."""
    run = ds_runs.get(
        ours(
            1,
            "--dtype",
            "bf16",
            "--offload-states-at",
            "3",
            "--offload-include",
            include,
            "--offload-gap-s",
            str(OFFLOAD_GAP_S),
            opts=LAYOUTS[layout],
            script=GENERATING,
        )
    ).ok()
    ref = ds_runs.get(baseline(1, "bf16")).ok()
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=STOCK_RTOL["bf16"], atol=0)
    recs = run.telemetry()
    if layout == "lane-on-cpu":  # the device tier went to host memory and came back at the next step
        assert [r["device_tier_subgroups"] for r in recs] == [2] * 6
    after = recs[3]  # the step after the cycle
    assert [r["excluded_s"] > 0 for r in recs] == [i == 3 for i in range(6)]
    assert after["excluded_s"] >= OFFLOAD_GAP_S and after["fwd_bwd_s"] < OFFLOAD_GAP_S / 2, after


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run_dir / "losses.jsonl")]
