"""Loading a DeepSpeed checkpoint: what is wrong with one that does not load, in one line.

:func:`guard_load_checkpoint` wraps a DeepSpeed engine's ``load_checkpoint`` (offloadctl's and
stock's alike, under ``offloadctl train``): a failure deep inside DeepSpeed becomes a
:class:`engine.errors.CheckpointError` naming the file and what differs, with the fix:

- the directory or tag does not exist;
- a rank's file is missing (saved by N ranks, fewer files there);
- a file is truncated or damaged (not a complete ``torch.save`` archive);
- the checkpoint was saved by another number of ranks;
- it holds another model (a parameter's shape or name differs);
- its optimizer state has other subgroups (another ``sub_group_size``; the engine's own check,
  made before it writes anything, in ``OffloadZero3Optimizer._rigid_load_state_dict``).

Every rank runs :func:`preflight` first (names, sizes, zip directories, and the small model-states
file for the rank count), so that all ranks stop together with the same line; what only the
load itself finds is diagnosed after it fails, from the error and the files' names.
"""
from __future__ import annotations

import glob
import os
import re
import zipfile

from engine.errors import CheckpointError

_SHAPE = re.compile(r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\([^)]*\)) from checkpoint, "
                    r"the shape in current model is (torch\.Size\([^)]*\))")
_KEYS = re.compile(r"(Missing key\(s\)|Unexpected key\(s\)) in state_dict: ([^.]+)\.")


def dp_world_size(engine) -> int:
    """The number of data-parallel ranks ``engine`` runs with (what a checkpoint must match)."""
    size = getattr(engine, "seq_dp_world_size", None) or getattr(engine, "dp_world_size", None)
    if size:
        return int(size)
    import deepspeed.comm as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def preflight(load_dir: str, tag, *, world_size: int, universal: bool, optimizer_states: bool) -> None:
    """Every rank checks the whole checkpoint before any rank reads it, so that all of them stop
    with the same line (a rank that stopped alone would leave the others in a collective, ending
    in a peer's traceback): the directory and tag, every file a complete archive, every rank's
    files there, the rank count it was saved with."""
    tag = _tag(load_dir, tag)
    if tag is None:
        raise _every_rank(f"checkpoint {load_dir} has no 'latest' file naming a tag: pass the tag to "
                          f"load_checkpoint, or check the directory")
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        tags = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) \
            if os.path.isdir(load_dir) else []
        raise _every_rank(f"checkpoint {folder} does not exist: check the path and tag (tags in {load_dir}: "
                          f"{tags or 'none'})")
    if universal:
        return  # another layout (zero/<param>/...), loaded at any rank count: DeepSpeed checks it
    bad = _damaged_file(folder)
    if bad:
        raise _every_rank(bad)
    model_files = sorted(glob.glob(os.path.join(folder, "*mp_rank_00_model_states.pt")))
    if not model_files:
        raise _every_rank(f"checkpoint {folder} has no model states file (*mp_rank_00_model_states.pt): it is not a "
                          f"DeepSpeed checkpoint, or it was not saved completely")
    import torch

    saved = int(torch.load(model_files[0], map_location="cpu", weights_only=False).get("dp_world_size") or 1)
    for kind in ("model_states", "optim_states"):
        present = {int(m.group(1)) for f in glob.glob(os.path.join(folder, f"*zero_pp_rank_*_mp_rank_00_{kind}.pt"))
                   if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)))}
        gone = sorted(set(range(saved)) - present)
        if gone and (present or kind == "optim_states"):
            raise _every_rank(f"checkpoint {folder} was saved by {saved} ranks and lacks the {kind} file of rank(s) "
                              f"{gone}: copy the missing files from where it was saved, or resume from another "
                              f"checkpoint")
    if optimizer_states and saved != world_size:
        raise _every_rank(f"checkpoint {folder} was saved by {saved} ranks and this run has {world_size}: run with "
                          f"{saved} ranks, or convert it with `python -m deepspeed.checkpoint.ds_to_universal` and "
                          f"set \"checkpoint\": {{\"load_universal\": true}} in the ds_config")


def _every_rank(msg: str) -> CheckpointError:
    e = CheckpointError(msg)
    e.every_rank = True  # every rank raises it: the bootstrap prints it once
    return e


def _tag(load_dir: str, tag) -> str | None:
    if tag is not None:
        return str(tag)
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def describe_failure(load_dir: str, tag, error: BaseException) -> str:
    """One line for a load that passed :func:`preflight` and failed inside DeepSpeed: the
    checkpoint, what differs (read from the error) and the fix."""
    folder = os.path.join(load_dir, _tag(load_dir, tag) or "")
    text = " ".join(str(error).split())
    gone = getattr(error, "filename", None)
    if isinstance(error, FileNotFoundError) and gone:
        return (f"checkpoint {folder} lacks {gone}: copy it from where the checkpoint was saved, or resume from "
                f"another checkpoint")
    m = _SHAPE.search(text)
    if m:
        return (f"checkpoint {folder} holds another model: {m.group(1)} is {m.group(2)} there and {m.group(3)} "
                f"here; load a checkpoint of this model")
    m = _KEYS.search(text)
    if m:
        return (f"checkpoint {folder} holds another model: {m.group(1).lower()} {m.group(2)[:200]}; load a "
                f"checkpoint of this model (or pass load_module_strict=False)")
    return f"checkpoint {folder} did not load ({type(error).__name__}: {text[:300]})"


def _damaged_file(folder: str) -> str | None:
    for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        if not zipfile.is_zipfile(path):
            return (f"checkpoint file {path} is truncated or damaged ({os.path.getsize(path)} bytes, not a complete "
                    f"torch.save archive): restore it, or resume from another checkpoint")
    return None
