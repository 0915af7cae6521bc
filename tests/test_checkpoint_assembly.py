"""Checkpoints put together wrong: every record passes its CRC-32, but the files come from
different saves or ranks (a partial rsync, a copy script's typo). Each is refused before anything
loads, in one line naming the file and what disagrees; a sound one still resumes to the same
losses. And a ``latest`` file that names no tag says what is wrong with it.

Real DeepSpeed checkpoints of two ranks (gloo on the CPU), saved by offloadctl at steps 4 and 8
of one 8-step run, and by stock DeepSpeed."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from ds_runs import LAYOUTS, baseline, launch, ours

from engine.errors import CheckpointError

STEPS = ("--steps", "8", "--dtype", "fp32")


def _saved_at(step: int):
    return ours(2, *STEPS, "--save-at", str(step), "--ckpt-dir", "{dir}/ckpt", opts=LAYOUTS["all-nvme"])


def _files(ckpt: str, kind: str) -> list[str]:
    return sorted(glob.glob(os.path.join(ckpt, "ckpt", f"zero_pp_rank_*_mp_rank_00_{kind}.pt")))


def _resume(ckpt: str, tmp_path):
    return launch(ours(2, *STEPS, "--resume", ckpt, opts=LAYOUTS["all-nvme"]), tmp_path / "load")


@pytest.mark.slow
def test_a_sound_checkpoint_resumes_to_the_same_losses(ds_runs, tmp_path):
    """The checks refuse nothing sound: step 4's checkpoint resumes to the losses of steps 5-8 of
    the run that saved it."""
    run = ds_runs.get(_saved_at(4)).ok()
    p = _resume(run.copy_of("ckpt", tmp_path / "ckpt"), tmp_path).ok()
    torch.testing.assert_close(torch.tensor(p.losses), torch.tensor(run.losses[4:]), rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["optim-of-a-later-save", "model-of-a-later-save", "rank-0-optim-over-rank-1", "stock-rank-0-optim-over-rank-1"]
)
def test_files_put_together_wrong_are_one_line(kind, ds_runs, tmp_path):
    """Step 8's optimizer states in step 4's folder, step 8's model states in step 4's, rank 0's
    optimizer file copied over rank 1's (offloadctl's checkpoint and stock's): exit 2, one line
    naming the file and what disagrees, nothing trained."""
    saver = baseline(2, "fp32") if kind.startswith("stock") else _saved_at(4)
    ckpt = ds_runs.get(saver).ok().copy_of("ckpt", tmp_path / "ckpt")
    fix = "the folder mixes files of two saves; copy the whole folder of one save, or resume from another checkpoint"
    if kind.endswith("-of-a-later-save"):
        later = ds_runs.get(_saved_at(8)).ok().dir / "ckpt"
        what = "optim_states" if kind.startswith("optim") else "model_states"
        for f in _files(str(later), what):
            shutil.copy(f, os.path.join(ckpt, "ckpt"))
        optim, model = _files(ckpt, "optim_states")[0], _files(ckpt, "model_states")[0]
        saved = (8, 4) if what == "optim_states" else (4, 8)
        want = f"checkpoint file {optim} was saved at step {saved[0]} and {model} at step {saved[1]}: {fix}"
    else:
        rank0, rank1 = _files(ckpt, "optim_states")
        shutil.copy(rank0, rank1)
        want = (
            f"checkpoint file {rank1} was saved as {os.path.basename(rank0)} (the name its records carry), not as "
            f"{os.path.basename(rank1)}: another file was copied over it; copy this one from where the checkpoint "
            f"was saved, or resume from another checkpoint"
        )
    p = _resume(ckpt, tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == f"offloadctl: {want}", p.stderr[-3000:]
    assert not os.path.exists(tmp_path / "load" / "losses.jsonl")


def test_a_stock_optimizer_file_of_a_later_save_is_refused(tmp_path):
    """Stock DeepSpeed's optimizer states carry no step of their own, only their updates: a file
    with more updates than its model states' steps (less the skipped ones) is of a later save."""
    import integrations.checkpoints as checkpoints

    folder = tmp_path / "ckpt" / "global_step4"
    folder.mkdir(parents=True)
    model = str(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    optim = str(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"global_steps": 4, "skipped_steps": 1, "dp_world_size": 1}, model)
    state = {"optimizer_state_dict": {"state": {0: {"step": 4, "exp_avg": torch.zeros(2)}}}}
    torch.save({"optimizer_state_dict": state}, optim)
    with pytest.raises(CheckpointError) as e:
        checkpoints.preflight(str(tmp_path / "ckpt"), "global_step4", world_size=1, universal=False, optimizer_states=True)
    assert str(e.value) == (
        f"checkpoint file {optim} holds the optimizer state after 4 updates and {model} was saved "
        f"at step 4: the folder mixes files of two saves; copy the whole folder of one save, or "
        f"resume from another checkpoint"
    )
    state["optimizer_state_dict"]["state"][0]["step"] = 3  # one of the 4 steps skipped: sound
    torch.save({"optimizer_state_dict": state}, optim)
    checkpoints.preflight(str(tmp_path / "ckpt"), "global_step4", world_size=1, universal=False, optimizer_states=True)


@pytest.mark.parametrize(
    "latest,want",
    [
        (b"", "is empty: it names no tag"),
        (b"\n", "is empty: it names no tag"),
        (b"s4\0", "holds 's4\\x00', which is not a tag (it has '\\x00' in it)"),
        (b"global\xff", "is not text (7 bytes, not UTF-8)"),
        (b"../etc", "holds '../etc', which is not a tag (it has '/' in it)"),
        (b"global_step9\n", "names tag 'global_step9', which is not there (tags there: ['global_step4'])"),
    ],
)
def test_a_latest_file_naming_no_tag_says_what_is_wrong_with_it(latest, want, tmp_path):
    """DeepSpeed reads the tag from ``latest`` when none is given: an empty one, one holding a NUL
    or a path, or naming a tag that is not there, is one line about ``latest``, with the tags there."""
    import integrations.checkpoints as checkpoints

    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step4").mkdir(parents=True)
    (ckpt / "latest").write_bytes(latest)
    with pytest.raises(CheckpointError) as e:
        checkpoints.preflight(str(ckpt), None, world_size=1, universal=False, optimizer_states=True)
    tags = "" if "not there" in want else " (tags there: ['global_step4'])"
    assert str(e.value) == (
        f"checkpoint {ckpt}'s 'latest' file {want}{';' if 'empty' in want else ':'} write the tag "
        f"to resume from into {ckpt / 'latest'}{tags}, or pass it to load_checkpoint"
    )
