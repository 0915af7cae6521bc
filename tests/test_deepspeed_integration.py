"""`offloadctl train` against stock DeepSpeed, on the real DeepSpeed (CPU accelerator, gloo).

The runs come from the session's cache (ds_runs.py): a stock reference or a saved checkpoint
that several tests compare with is launched once."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

import pytest
import torch
from ds_runs import ACCELERATE, HF_TRAINER, LANE_ON_CPU, LANE_ON_CPU_2, SAVE, TINY, Launch, baseline, launch, ours, stock
from helpers import ROOT, cli

from engine.storage.native_ops import load_cpu_adam

# Real `offloadctl train` runs, processes and signals: minutes; `pytest -m "not slow"` skips them.
pytestmark = pytest.mark.slow

SCRIPT = TINY


@pytest.mark.skipif(load_cpu_adam() is None, reason="needs DeepSpeed's cpu_adam op")
def test_the_default_kernel_gives_stocks_losses_bit_for_bit(ds_runs):
    """By default (``--host-adam auto``, the op built) the host lane runs stock's cpu_adam, and the
    losses are stock's exactly, not within a tolerance; ``--host-adam torch`` rounds differently in
    the last bit, which is why the default is not the faster of the two."""
    ref = ds_runs.reference(baseline(1, "bf16")).ok()
    b = ds_runs.get(ours(1, "--dtype", "bf16")).ok()
    assert "offloadctl: engine active" in b.stderr
    assert len(b.losses) == 6 and b.losses == ref.losses, (b.losses, ref.losses)
    t = ds_runs.get(ours(1, "--dtype", "bf16", opts=("--host-adam", "torch"))).ok()
    assert len(t.losses) == 6 and t.losses != ref.losses, "torch's kernel gave stock's losses: this test shows nothing"


@pytest.mark.parametrize(
    "ranks,dtype,opts,script_opts",
    [
        (1, "fp32", (), ()),
        (2, "fp32", ("--node-lock",), ()),
        (1, "bf16", (), ()),
        (1, "fp32", (), ("--groups",)),
        # Dynamic loss scaling; step 3's gradients overflow, so DeepSpeed skips it and halves the scale.
        (1, "fp16", (), ("--overflow-at", "3")),
        # The GPU path's bookkeeping, run on the CPU: a device tier and the device lane for half the
        # rest, their gradients written by DeepSpeed's backward into the engine's own buffers
        # (accumulated over 2 micro-steps), unscaled as they are read, overflow seen there.
        (1, "bf16", LANE_ON_CPU, ()),
        (2, "fp32", LANE_ON_CPU_2, ()),
        (1, "fp16", LANE_ON_CPU, ("--overflow-at", "3", "--overflow-in", "first")),
    ],
    ids=[
        "1rank-fp32",
        "2ranks-fp32-nodelock",
        "1rank-bf16",
        "1rank-param-groups",
        "1rank-fp16-overflow-skip",
        "lane-on-cpu-bf16",
        "lane-on-cpu-2ranks",
        "lane-on-cpu-fp16-overflow-skip",
    ],
)
def test_losses_match_stock_deepspeed(ranks, dtype, opts, script_opts, ds_runs):
    if torch.cuda.is_available() and opts not in (LANE_ON_CPU, LANE_ON_CPU_2):
        # On a GPU the default keeps this tiny model's whole state in the device tier (see
        # test_gpu_default_keeps_a_small_state_on_the_device): these rows test the NVMe tier, so
        # they keep the state off the GPU.
        opts = (*opts, "--device-cache", "0", "--device-fraction", "0")
    # The plain rows save a checkpoint at step 3 on both sides, so that the checkpoint tests reuse
    # these runs (a save changes no loss: stock's losses with and without one are identical).
    save = () if script_opts or opts else SAVE
    ref = ds_runs.reference(baseline(ranks, dtype) if not script_opts else stock(ranks, "--dtype", dtype, *script_opts)).ok()
    b = ds_runs.get(ours(ranks, "--dtype", dtype, *script_opts, *save, opts=opts)).ok()
    assert "offloadctl: engine active" in b.stderr
    assert len(ref.losses) == len(b.losses) == 6
    torch.testing.assert_close(torch.tensor(b.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    assert ref.loss_scales == b.loss_scales
    skipped = 1 if "--overflow-at" in script_opts else 0
    # The state really went to the NVMe tier, from every rank, and the swap files are gone. (It
    # is not read back: this model's few swapped subgroups fit the staging buffers, which keep
    # the copies whose writes landed; test_numerics reads state back through the same engine.)
    for rank in range(ranks):
        recs = b.telemetry(rank)
        assert len(recs) == 6 - skipped and sum(r["bytes_written"].get("nvme", 0) for r in recs) > 0
        # The skipped iteration (step 3) is no part of the next step's time (the tuner's clock).
        assert [r["excluded_s"] > 0 for r in recs] == [bool(skipped) and i == 2 for i in range(len(recs))]
        if opts in (LANE_ON_CPU, LANE_ON_CPU_2):
            # Of the 2 subgroups outside the tier, the lane takes half (1) or all (2).
            assert recs[-1]["device_tier_subgroups"] == 2
            assert recs[-1]["device_lane_subgroups"] == (1 if opts == LANE_ON_CPU else 2)
    assert glob.glob(str(b.nvme / "offloadctl-swap-*" / "*" / "*.swp")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_default_keeps_a_small_state_on_the_device(ds_runs):
    """On a GPU, with the defaults (--device-cache auto), a state that fits what the GPU has free
    after forward/backward stays there: every subgroup in the device tier, nothing read from
    NVMe; losses as stock DeepSpeed's (its CPU Adam against our GPU fused AdamW: rounding only)."""
    ref = ds_runs.get(baseline(1, "fp32")).ok()
    b = ds_runs.get(
        Launch("ours", 1, ("--dtype", "fp32"), opts=("--nvme", "{dir}/nvme", "--run-dir", "{dir}/run", "--tuner", "off"))
    ).ok()
    torch.testing.assert_close(torch.tensor(b.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    recs = b.telemetry()
    assert recs[-1]["device_tier_subgroups"] == 4 and recs[-1]["device_lane_subgroups"] == 0
    assert sum(r["bytes_read"].get("nvme", 0) for r in recs) == 0


@pytest.mark.parametrize(
    "script,ranks,extra,opts",
    [
        (HF_TRAINER, 1, ("--output-dir", "{dir}/out"), ()),
        # Few subgroups per rank: without prefetch only one is kept across steps, so the rest are read.
        (ACCELERATE, 2, (), ("--prefetch-depth", "0")),
    ],
    ids=["hf-trainer-1rank", "accelerate-2ranks"],
)
def test_hugging_face_paths_match_stock_deepspeed(script, ranks, extra, opts, ds_runs):
    """Trainer and Accelerate reach deepspeed.initialize themselves; the engine must engage there too,
    leave the user's RNG alone (GPT-2 has dropout) and keep their LR scheduler stepping."""
    ref = ds_runs.reference(stock(ranks, *extra, script=script)).ok()
    b = ds_runs.get(ours(ranks, *extra, script=script, opts=opts)).ok()
    assert "offloadctl: engine active" in b.stderr
    assert "lr_scheduler.step()` before `optimizer.step()" not in b.stderr
    assert len(ref.losses) == len(b.losses) == 6
    torch.testing.assert_close(torch.tensor(b.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    for rank in range(ranks):
        assert sum(r["bytes_written"].get("nvme", 0) for r in b.telemetry(rank)) > 0  # written; read back: see above
    # DeepSpeed's CPU comm op leaves a 64 MiB /dev/shm buffer per rank; offloadctl removes its run's.
    port = b.port
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*") == []


def test_checkpoint_resume_matches_uninterrupted_run(ds_runs, tmp_path):
    full = ds_runs.get(ours(1, "--dtype", "fp32", *SAVE)).ok()
    resumed = launch(ours(1, "--dtype", "fp32", "--resume", full.copy_of("ckpt", tmp_path / "ckpt")), tmp_path / "resumed").ok()
    assert len(resumed.losses) == 3
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[3:]), rtol=1e-5, atol=0)


def _one_line_error(out, pattern):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    import re

    assert re.search(pattern, out.stderr), out.stderr[-3000:]


def test_missing_script(tmp_path):
    out = cli("train", str(tmp_path / "nope.py"))
    _one_line_error(out, r"offloadctl: training script .*nope.py does not exist")


def test_invalid_nvme_path(tmp_path):
    out = cli("train", "--nvme", str(tmp_path / "missing"), SCRIPT)
    _one_line_error(out, r"storage path .*missing does not exist.*mkdir -p")


def test_stage_2_is_refused(tmp_path):
    out = launch(ours(1, "--stage", "2"), tmp_path)
    _one_line_error(out, r"offloadctl: offloadctl's engine needs ZeRO stage 3, but this ds_config uses stage 2")


def test_fp16_torch_autocast_is_refused(tmp_path):
    """torch_autocast with fp16 scales the loss with torch's GradScaler inside DeepSpeed's
    per-subgroup step, which the engine replaces: refused with the fix, not run unscaled."""
    out = launch(ours(1, "--ds-extra", json.dumps({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}})), tmp_path)
    _one_line_error(out, r"offloadctl: torch_autocast with fp16 .* use bf16 in torch_autocast")


def test_script_that_never_initializes(tmp_path):
    out = launch(ours(1, "--no-init"), tmp_path)
    _one_line_error(out, r"finished without calling deepspeed.initialize")


def test_dry_run_prints_the_launch(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = cli("train", "--dry-run", "--json", "--num_gpus", "2", "--nvme", str(nvme), "--node-lock", SCRIPT, "--steps", "3")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["command"][3:6] == ["deepspeed.launcher.runner", "--num_gpus", "2"]
    assert plan["command"][-3:] == [SCRIPT, "--steps", "3"]
    assert plan["settings"]["nvme_paths"] == [str(nvme)]
    assert plan["settings"]["knobs"]["node_lock"] is True


def _profile_for(nvme, out):
    """The shipped example profile, pointed at ``nvme``: a valid profile without measuring."""
    import dataclasses

    from perf.profile_toml import load_profile, save_profile

    p = load_profile(os.path.join(ROOT, "profiles", "example-cpu-vm.toml"))
    p = dataclasses.replace(p, name="test-profile", paths=tuple(dataclasses.replace(q, path=str(nvme)) for q in p.paths))
    return save_profile(p, str(out))


def test_profile_starts_from_the_model_plan(tmp_path):
    from engine.config import StoragePath
    from perf.plan import plan_for_rank

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    prof = _profile_for(nvme, tmp_path / "p.toml")
    out = launch(ours(1, opts=("--profile", prof, "--tuner", "off")), tmp_path).ok()
    banner = " ".join(out.stderr.split())  # the start lines are wrapped to the terminal
    assert "profile test-profile: predicted update" in banner and "tuner off" in banner
    recs = out.telemetry()
    # The rank ran with the knobs the model picks for its size (the tiny model's 4 subgroups).
    params = recs[0]["params"]
    expected = plan_for_rank(
        prof,
        params_total=params,
        world_size=1,
        subgroup_numel=100,
        paths=(StoragePath(path=str(nvme)),),
        weight_bytes=4,
        host_cache_bytes=2000,
        pins={},
    )
    assert recs[0]["knobs"]["prefetch_depth"] == expected.knobs.prefetch_depth
    assert all(r["knobs"] == recs[0]["knobs"] for r in recs)  # --tuner off: never changed


def test_tuner_auto_starts_a_private_daemon_and_stops_it(tmp_path):
    spec = ours(2, opts=("--prefetch-depth", "1", "--host-memory", "1GB"))
    # No daemon at the default socket: a runtime dir of the test's own.
    out = launch(dataclasses.replace(spec, env=(("XDG_RUNTIME_DIR", str(tmp_path / "xdg")),)), tmp_path).ok()
    # The flags given are the run's: the tuner never moves the prefetch, the engine keeps to the
    # budget, and the summary says both.
    for rank in (0, 1):
        assert all(
            r["knobs"]["prefetch_depth"] == 1 and r["host_budget_bytes"] == 10**9 and 0 < sum(r["host_bytes"].values()) <= 10**9
            for r in out.telemetry(rank)
        )
    summary = " ".join(out.stdout.split())
    assert "knobs fixed by the run's options, never tuned: prefetch_depth=1" in summary, out.stdout
    assert re.search(r"host memory of rank 0's engine, at its peak: [\d.]+ [KM]B of its 1 GB budget \(", summary), out.stdout
    sock = out.run_dir / "tuner" / "tuner.sock"
    assert "tuner: this run's own" in out.stderr  # the start banner: the daemon is the run's, in its run dir
    log = open(str(sock) + ".log").read()
    assert "rank 0/2 registered" in log and "rank 1/2 registered" in log and "stopped" in log
    assert not sock.exists()  # the private daemon went with the run


@pytest.mark.parametrize(
    "opts,pattern",
    [
        (("--profile", "no-such-profile"), r"no-such-profile"),
        (("--tuner", "/nonexistent/tuner.sock"), r"--tuner /nonexistent/tuner.sock: no socket there"),
        (("--profile", "{bad}"), r"line \d+"),
    ],
    ids=["unknown-profile", "missing-socket", "malformed-profile"],
)
def test_bad_profile_or_tuner_is_one_line(opts, pattern, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('schema_version = 1\nname = "x"\nbogus = 3\n')
    opts = [o.format(bad=bad) for o in opts]
    out = cli("train", "--nvme", str(tmp_path), *opts, SCRIPT)
    _one_line_error(out, pattern)


def test_dry_run_passes_multi_node_options_through(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    out = cli(
        "train",
        "--dry-run",
        "--json",
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        "2",
        "--include",
        "node1:0,1@node2:0,1",
        "--master_addr",
        "node1",
        "--launcher",
        "pdsh",
        "--nvme",
        str(tmp_path),
        "--tuner",
        "off",
        SCRIPT,
        "--steps",
        "3",
        "--num_nodes",
        "7",
    )
    assert out.returncode == 0, out.stderr
    cmd = json.loads(out.stdout)["command"]
    launcher = cmd[cmd.index("deepspeed.launcher.runner") + 1 : cmd.index(os.path.join(ROOT, "integrations", "bootstrap.py"))]
    # In the order of DeepSpeed's own parser (integrations.launcher.LAUNCHER_OPTIONS).
    assert launcher == [
        "--hostfile",
        str(hostfile),
        "--include",
        "node1:0,1@node2:0,1",
        "--num_nodes",
        "2",
        "--master_addr",
        "node1",
        "--launcher",
        "pdsh",
    ]
    assert cmd[-5:] == [SCRIPT, "--steps", "3", "--num_nodes", "7"]  # the script's own args, untouched
