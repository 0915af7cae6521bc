"""No lock-in: DeepSpeed's documented APIs work with the engine in place, and checkpoints move
between stock DeepSpeed and offloadctl both ways, on real DeepSpeed runs (CPU accelerator, gloo).

Every comparison is against stock DeepSpeed running the same script with the same seed.
"""
from __future__ import annotations

import pytest
import torch
from test_deepspeed_integration import LANE_ON_CPU, _losses, ours, stock

pytestmark = pytest.mark.slow

# Where the state lives in our runs: on NVMe with a 2 kB host cache (the helper's default), all
# of it on NVMe, on the GPU path's tiers (device tier, device lane, NVMe) run on the CPU.
LAYOUTS = {"nvme-and-host": (), "all-nvme": ("--host-cache", "0"), "lane-on-cpu": LANE_ON_CPU,
           "all-host": ("--host-cache", "1GB")}


def _read_values(path: str, ranks: int) -> list[dict]:
    return [torch.load(f"{path}.rank{r}") for r in range(ranks)]


@pytest.mark.parametrize("ranks,dtype,layout", [(1, "fp32", "all-nvme"), (2, "bf16", "nvme-and-host"),
                                                (1, "bf16", "lane-on-cpu")])
def test_partitioned_state_api_matches_stock(ranks, dtype, layout, tmp_path):
    """deepspeed.utils.safe_get_*/safe_set_* and safe_update_full_grad_vectorized ("Debugging"
    and "Modifying Partitioned States" in DeepSpeed's ZeRO-3 docs), with gradient clipping: every
    value read at step 2 equals stock's, and the losses after the writes at step 3 do too. A
    subgroup on NVMe is read from and written to its swap file."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    api = ("--state-api-out",)
    a = stock(ranks, str(tmp_path / "stock.jsonl"), "--dtype", dtype, *api, str(tmp_path / "stock.pt"))
    assert a.returncode == 0, a.stderr[-3000:]
    b = ours(ranks, str(tmp_path / "ours.jsonl"), str(nvme), str(tmp_path / "run"), "--dtype", dtype, *api,
             str(tmp_path / "ours.pt"), opts=LAYOUTS[layout])
    assert b.returncode == 0, b.stderr[-3000:]
    for ref, got in zip(_read_values(str(tmp_path / "stock.pt"), ranks), _read_values(str(tmp_path / "ours.pt"), ranks)):
        assert ref.keys() == got.keys() and len(ref) == 48  # 6 parameters x 8 getters
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "ours.jsonl")), torch.tensor(_losses(tmp_path / "stock.jsonl")),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["all-nvme", "lane-on-cpu"])
def test_module_only_load_of_a_stock_checkpoint_matches_stock(layout, tmp_path):
    """load_checkpoint(load_optimizer_states=False, load_module_only=True), fine-tuning from a
    checkpoint: the masters come from the loaded weights, as in stock. The checkpoint is stock's."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ckpt = str(tmp_path / "ckpt")
    a = stock(1, str(tmp_path / "full.jsonl"), "--save-at", "3", "--ckpt-dir", ckpt)
    assert a.returncode == 0, a.stderr[-3000:]
    only = ("--resume", ckpt, "--resume-module-only")
    ref = stock(1, str(tmp_path / "stock.jsonl"), *only)
    assert ref.returncode == 0, ref.stderr[-3000:]
    b = ours(1, str(tmp_path / "ours.jsonl"), str(nvme), str(tmp_path / "run"), *only, opts=LAYOUTS[layout])
    assert b.returncode == 0, b.stderr[-3000:]
    got, want = _losses(tmp_path / "ours.jsonl"), _losses(tmp_path / "stock.jsonl")
    assert len(got) == len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


# -- checkpoints, both ways ------------------------------------------------------------------------

TWO_PATHS = "two-paths"
STOCK_RTOL = {"fp32": 1e-5, "bf16": 2e-3}
"""Losses against stock's: the host lane's kernel (torch's fused AdamW or DeepSpeedCPUAdam, the
faster here, engine.host_kernel) rounds the fp32 master differently in the last bit from stock's
DeepSpeedCPUAdam; in bf16 that can flip a weight's last of 8 mantissa bits (2^-8 = 0.4%), and a
loss moves by a small share of that. Resumed against uninterrupted runs of the same engine and
kernel, every dtype is held to 1e-5."""


def _tiers(tmp_path, name: str, layout: str) -> tuple[str, tuple[str, ...]]:
    """(--nvme path, extra options) of a layout, its directories made under ``tmp_path/name``."""
    base = tmp_path / name
    first = base / "nvme0"
    first.mkdir(parents=True)
    if layout == TWO_PATHS:  # state split over two paths, none in host memory
        (base / "nvme1").mkdir()
        return str(first), ("--nvme", str(base / "nvme1"), "--host-cache", "0")
    return str(first), LAYOUTS[layout]


_STOCK_LOSSES: dict[tuple, list[float]] = {}
"""Stock runs that only train (no checkpoint, no state read), by ranks, dtype and options: the
same reference for every test that compares with one (each run is tens of seconds here)."""


def _run(who: str, tmp_path, name: str, ranks: int, dtype: str, layout: str | None, *extra):
    key = (ranks, dtype, extra)
    if who == "stock" and not extra and key in _STOCK_LOSSES:
        return _STOCK_LOSSES[key]
    out = str(tmp_path / f"{name}.jsonl")
    if who == "stock":
        p = stock(ranks, out, "--dtype", dtype, *extra)
    else:
        nvme, opts = _tiers(tmp_path, name, layout)
        p = ours(ranks, out, nvme, str(tmp_path / f"run-{name}"), "--dtype", dtype, *extra, opts=opts)
    assert p.returncode == 0, p.stderr[-3000:]
    if who == "stock" and not extra:
        _STOCK_LOSSES[key] = _losses(out)
    return _losses(out)


@pytest.mark.parametrize("saver,loader,ranks,dtype", [
    (("stock", None), ("ours", "all-nvme"), 2, "fp32"),
    (("stock", None), ("ours", TWO_PATHS), 1, "bf16"),
    (("ours", "nvme-and-host"), ("stock", None), 2, "bf16"),
    (("ours", "all-nvme"), ("ours", TWO_PATHS), 2, "fp32"),
    (("ours", TWO_PATHS), ("ours", "lane-on-cpu"), 1, "bf16"),
    (("ours", "all-host"), ("ours", "all-nvme"), 1, "fp32"),
], ids=["stock-to-ours-2ranks-fp32", "stock-to-ours-two-paths-bf16", "ours-to-stock-2ranks-bf16",
        "ours-to-ours-other-paths-2ranks", "ours-to-ours-device-tiers-bf16", "ours-host-to-ours-nvme"])
def test_checkpoints_move_both_ways(saver, loader, ranks, dtype, tmp_path):
    """A checkpoint saved at step 3 (gradient clipping on) and resumed by the other side, or by
    offloadctl with another tier layout, continues with the losses of the uninterrupted run. The
    loading run never sees the saving run's tiers."""
    ckpt = str(tmp_path / "ckpt")
    full = _run(saver[0], tmp_path, "full", ranks, dtype, saver[1], "--save-at", "3", "--ckpt-dir", ckpt)
    resumed = _run(loader[0], tmp_path, "resumed", ranks, dtype, loader[1], "--resume", ckpt)
    assert len(full) == 6 and len(resumed) == 3
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[3:]), rtol=1e-5, atol=0)
    if saver[0] == "ours":  # the uninterrupted run itself is stock's
        ref = _run("stock", tmp_path, "stock", ranks, dtype, None)
        torch.testing.assert_close(torch.tensor(full), torch.tensor(ref), rtol=STOCK_RTOL[dtype], atol=0)


def test_zero_to_fp32_reads_our_checkpoint_as_stocks(tmp_path):
    """DeepSpeed's zero_to_fp32 on offloadctl's checkpoint gives the weights it gives on stock's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for who, layout in (("stock", None), ("ours", TWO_PATHS)):
        _run(who, tmp_path, who, 2, "bf16", layout, "--save-at", "3", "--ckpt-dir", str(tmp_path / f"ckpt-{who}"))
    ref = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt-stock"), tag="ckpt")
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt-ours"), tag="ckpt")
    assert ref.keys() == got.keys() and len(ref) == 6
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def _to_universal(ckpt: str) -> None:
    import subprocess
    import sys

    from test_deepspeed_integration import ROOT, _env

    p = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        f"{ckpt}/ckpt", "--output_folder", f"{ckpt}/universal"], capture_output=True, text=True,
                       timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.parametrize("saved_ranks,loaded_ranks", [(2, 1), (1, 2)])
def test_universal_checkpoint_of_ours_resumes_at_another_rank_count(saved_ranks, loaded_ranks, tmp_path):
    """DeepSpeed's universal checkpoint (ds_to_universal) made from offloadctl's checkpoint resumes
    at a different number of ranks, under offloadctl (other tiers) and under stock, as stock's own
    universal checkpoint does. (At another rank count the data per step differs, so the reference
    is stock resuming from stock's universal checkpoint, not the uninterrupted run.)"""
    universal = ("--resume-tag", "universal", "--ds-extra", '{"checkpoint": {"load_universal": true}}')
    for who, layout in (("stock", None), ("ours", "all-nvme")):
        ckpt = str(tmp_path / f"ckpt-{who}")
        _run(who, tmp_path, f"save-{who}", saved_ranks, "fp32", layout, "--save-at", "3", "--ckpt-dir", ckpt)
        _to_universal(ckpt)
    ref = _run("stock", tmp_path, "stock-from-stock", loaded_ranks, "fp32", None, "--resume",
               str(tmp_path / "ckpt-stock"), *universal)
    ours_ckpt = str(tmp_path / "ckpt-ours")
    stock_from_ours = _run("stock", tmp_path, "stock-from-ours", loaded_ranks, "fp32", None, "--resume", ours_ckpt,
                           *universal)
    ours_from_ours = _run("ours", tmp_path, "ours-from-ours", loaded_ranks, "fp32", TWO_PATHS, "--resume", ours_ckpt,
                          *universal)
    assert len(ref) == 3
    for got in (stock_from_ours, ours_from_ours):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)


# -- checkpoints that do not load ----------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_by_ours(tmp_path_factory):
    """Checkpoints offloadctl saved at step 3 (fp32, state on NVMe), by 1 and by 2 ranks: made
    once for the tests below, each of which damages its own copy."""
    out = {}
    for ranks in (1, 2):
        d = tmp_path_factory.mktemp(f"saved{ranks}")
        _run("ours", d, "saver", ranks, "fp32", "all-nvme", "--save-at", "3", "--ckpt-dir", str(d / "ckpt"))
        out[ranks] = d / "ckpt"
    return out


def _saved(saved_by_ours, tmp_path, ranks: int) -> str:
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_by_ours[ranks], ckpt)
    return str(ckpt)


def _damage(kind: str, ckpt: str) -> None:
    import glob
    import os

    optim = sorted(glob.glob(os.path.join(ckpt, "ckpt", "*optim_states.pt")))
    if kind == "truncated":
        with open(optim[0], "r+b") as f:
            f.truncate(os.path.getsize(optim[0]) // 2)
    elif kind == "missing-rank-file":
        os.unlink(optim[-1])


@pytest.mark.parametrize("kind,ranks,load_ranks,extra,expect", [
    ("another-model", 1, 1, ("--hidden", "48"), "holds another model: 0.weight is torch.Size([64, 32]) there and "
                                                 "torch.Size([48, 32]) here"),
    ("missing-rank-file", 2, 2, (), "lacks"),
    ("truncated", 1, 1, (), "is truncated or damaged"),
    ("rank-count", 2, 1, (), "was saved by 2 ranks and this run has 1"),
    ("other-subgroups", 1, 1, ("--sub-group-size", "50"), "subgroups of"),
])
def test_a_checkpoint_that_does_not_load_is_one_line(kind, ranks, load_ranks, extra, expect, saved_by_ours, tmp_path):
    """One line naming the checkpoint file or directory, what differs and the fix; no traceback."""
    ckpt = _saved(saved_by_ours, tmp_path, ranks)
    _damage(kind, ckpt)
    nvme = tmp_path / "nvme-load"
    nvme.mkdir()
    p = ours(load_ranks, str(tmp_path / "load.jsonl"), str(nvme), str(tmp_path / "run-load"), "--resume", ckpt, *extra,
             opts=("--host-cache", "0"))
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("offloadctl: ") and expect in line and str(tmp_path / "ckpt") in line or "subgroups" in line, line
    assert "Traceback" not in p.stderr


def test_a_failed_load_leaves_the_tiers_alone(saved_by_ours, tmp_path):
    """A script that catches the failure and goes on finds the optimizer's state as it was, on
    every tier: the subgroup check comes before anything is written."""
    import json

    ckpt = _saved(saved_by_ours, tmp_path, 1)
    out = tmp_path / "try.json"
    _run("ours", tmp_path, "goes-on", 1, "fp32", "nvme-and-host", "--resume", ckpt, "--try-resume", str(out),
         "--sub-group-size", "50")
    got = json.loads(out.read_text())
    assert got["outcome"].startswith("failed: the checkpoint's optimizer state has") and got["tiers_unchanged"], got


# -- launching: two nodes, each launched on its own --------------------------------------------------

def test_two_nodes_launched_per_node_match_stock(tmp_path):
    """Two per-node launches (--no_ssh --node_rank 0|1, one hostfile naming both nodes, one master
    address), as on a cluster without ssh between nodes (Kubernetes, a Slurm step per node). Each
    "node" has its own NVMe path, run dir and tuner daemon; losses equal the same launch of stock
    DeepSpeed; each node's telemetry and report are complete."""
    import json
    import subprocess
    import sys

    from test_deepspeed_integration import ROOT, _env, _port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")

    def launch(who: str) -> list[dict]:
        port, procs = _port(), []
        for node in (0, 1):
            d = tmp_path / f"{who}{node}"
            (d / "nvme").mkdir(parents=True)
            per_node = ["--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
                        "127.0.0.1", "--master_port", port]
            script = ["tests/ds_scripts/train_tiny.py", "--losses-out", str(d / "losses.jsonl")]
            cmd = ([sys.executable, "-m", "deepspeed.launcher.runner", *per_node, *script] if who == "stock" else
                   [sys.executable, "-m", "offloadctl.cli", "train", *per_node, "--nvme", str(d / "nvme"),
                    "--host-cache", "0", "--run-dir", str(d / "run"), *script])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                                          cwd=ROOT))
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        return outs

    launch("stock")
    outs = launch("ours")
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "ours0" / "losses.jsonl")),
                               torch.tensor(_losses(tmp_path / "stock0" / "losses.jsonl")), rtol=1e-5, atol=0)
    for node in (0, 1):
        run = tmp_path / f"ours{node}" / "run"
        recs = [json.loads(line) for line in open(run / f"telemetry-rank{node}.jsonl")]  # node N runs rank N
        # Written to its own path (this model's swapped state fits the staging buffers, so it is not read back).
        assert len(recs) == 6 and sum(r["bytes_written"].get("nvme", 0) for r in recs) > 0
        assert "tuner" in outs[node] and (run / "tuner").is_dir()  # its own daemon
        p = subprocess.run([sys.executable, "-m", "offloadctl.cli", "report", str(run), "--output",
                            str(run / "report.html")], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
        assert p.returncode == 0 and (run / "report.html").stat().st_size > 10_000, p.stderr[-2000:]


@pytest.mark.parametrize("include,layout", [("all", "lane-on-cpu"), ("optim_states,hp_params", "all-nvme"),
                                            ("lp_params,lp_grads,contiguous_grad_buffer", "nvme-and-host")])
def test_offload_and_reload_states_keep_training_exact(include, layout, tmp_path):
    """engine.offload_states()/reload_states() (RLHF frameworks, around generation) after step 3:
    the state DeepSpeed's API reads is the same before and after (checked in the script), and
    training continues with stock's losses (stock runs without them: with CPU offload its own
    offload_states takes only the 16-bit states, so there is nothing to compare it with)."""
    import json

    losses = _run("ours", tmp_path, "ours", 1, "bf16", layout, "--offload-states-at", "3", "--offload-include", include)
    ref = _run("stock", tmp_path, "stock", 1, "bf16", None)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=STOCK_RTOL["bf16"], atol=0)
    if layout == "lane-on-cpu":  # the device tier went to host memory and came back at the next step
        recs = [json.loads(line) for line in open(tmp_path / "run-ours" / "telemetry-rank0.jsonl")]
        assert [r["device_tier_subgroups"] for r in recs] == [2] * 6
