"""A checkpoint of another model, or of another partition, under ZeRO-3 (issue 43, item 3): the
refusal is one line naming the file and what disagrees. The model's shapes come from the
model states file's ``param_shapes`` (ZeRO-3 saves every parameter as an empty placeholder, so
its module state says nothing); the partition sizes from this rank's optimizer file.

Real DeepSpeed checkpoints of two ranks (gloo on the CPU), saved by offloadctl at step 4: the
same run as tests/test_checkpoint_assembly.py's, so a session launches it once."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
from ds_runs import LAYOUTS, launch, ours

STEPS = ("--steps", "8", "--dtype", "fp32")
SAVER = ours(2, *STEPS, "--save-at", "4", "--ckpt-dir", "{dir}/ckpt", opts=LAYOUTS["all-nvme"])
FOLDER = os.path.join("ckpt", "ckpt")


def _resume(ckpt: str, tmp_path, *extra: str):
    return launch(ours(2, *STEPS, "--resume", ckpt, *extra, opts=LAYOUTS["all-nvme"]), tmp_path / "load")


def _refused(p) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.strip().splitlines() if line.startswith("offloadctl: ")]
    assert lines[-1] == p.stderr.strip().splitlines()[-1], p.stderr[-3000:]
    assert sum("holds another model" in line or "subgroups of" in line for line in lines) == 1, p.stderr[-3000:]
    return lines[-1]


@pytest.mark.slow
def test_a_checkpoint_of_another_model_names_the_parameter_and_both_shapes(ds_runs, tmp_path):
    """Saved with hidden 64, resumed with hidden 48 on two ranks: each rank's partition differs
    too, but the line says what the user changed: the first parameter whose shape differs, with
    both shapes, from the model states file's param_shapes; nothing trains."""
    ckpt = ds_runs.get(SAVER).ok().copy_of("ckpt", tmp_path / "ckpt")
    p = _resume(ckpt, tmp_path, "--hidden", "48")
    model = os.path.join(ckpt, "ckpt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert _refused(p) == (
        f"offloadctl: checkpoint file {model} holds another model: 0.weight is "
        f"torch.Size([64, 32]) there and torch.Size([48, 32]) here (its param_shapes); load a "
        f"checkpoint of this model, or check the script's model arguments"
    )
    assert not os.path.exists(tmp_path / "load" / "losses.jsonl")


@pytest.mark.slow
def test_partition_sizes_that_differ_name_this_ranks_optimizer_file(ds_runs, tmp_path):
    """The same model with another sub_group_size (5000: one subgroup per rank where the save has
    four): the line names this rank's optimizer file and the first subgroup whose size differs."""
    ckpt = ds_runs.get(SAVER).ok().copy_of("ckpt", tmp_path / "ckpt")
    p = _resume(ckpt, tmp_path, "--sub-group-size", "5000")
    optim = os.path.join(ckpt, "ckpt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    saved = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
    sizes = [int(t.numel()) for t in saved]
    assert len(sizes) == 4
    here = sum(sizes)  # one subgroup holds the rank's whole partition
    assert _refused(p) == (
        f"offloadctl: the checkpoint's optimizer state has 4 subgroups of "
        f"[{', '.join(map(str, sizes))}] elements (in {optim}) and rank 0's partition has 1 of "
        f"[{here}]: subgroup 0 has {sizes[0]} elements there and {here} here; it was saved with "
        f"another sub_group_size, model or rank count: load it with the same ones, or convert it "
        f"with ds_to_universal"
    )
    assert not os.path.exists(tmp_path / "load" / "losses.jsonl")


def _model_states(folder, shapes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g) for g in shapes], "dp_world_size": 1},
        str(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    )


def test_param_shapes_against_this_model(tmp_path):
    """The comparison itself, on a real model states file: the same shapes pass; a transposed
    weight (same sizes, so the partitions match) and another parameter count are named."""
    from integrations.checkpoints import another_model

    folder = tmp_path / "global_step4"
    _model_states(folder, [[("0.weight", (64, 32))], [("0.bias", (64,)), ("2.weight", (8, 64))]])
    model = str(folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert another_model(str(folder), 0, [[(64, 32)], [(64,), (8, 64)]]) is None
    assert another_model(str(folder), 0, [[(64, 32)], [(64,), (64, 8)]]) == (
        f"checkpoint file {model} holds another model: 2.weight is torch.Size([8, 64]) there and torch.Size([64, 8]) "
        f"here (its param_shapes); load a checkpoint of this model, or check the script's model arguments"
    )
    assert another_model(str(folder), 0, [[(64, 32)], [(64,), (8, 64), (8,)]]) == (
        f"checkpoint file {model} holds another model: 3 optimized parameters there and 4 here (its "
        f"param_shapes); load a checkpoint of this model, or check the script's model arguments"
    )
    torch.save({"dp_world_size": 1}, model)  # an older save with no shapes: the sizes are checked next
    assert another_model(str(folder), 0, [[(1,)]]) is None
