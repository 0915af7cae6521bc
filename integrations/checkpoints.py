"""Loading a DeepSpeed checkpoint: what is wrong with one that does not load, in one line.

:func:`integrations.ds_patches.guard_load_checkpoint` wraps a DeepSpeed engine's ``load_checkpoint``
(offloadctl's and stock's alike, under ``offloadctl train``): a failure deep inside DeepSpeed becomes a
:class:`engine.errors.CheckpointError` naming the file and what differs, with the fix:

- the directory or tag does not exist;
- a rank's file is missing (saved by N ranks, fewer files there);
- a file is truncated or damaged (not a complete ``torch.save`` archive, or a record whose bytes
  fail the CRC-32 the archive stores for it: :func:`damaged_record`);
- the checkpoint was saved by another number of ranks;
- it holds another model (a parameter's shape or name differs);
- its optimizer state has other subgroups (another ``sub_group_size``; the engine's own check,
  made before it writes anything, in ``OffloadZero3Optimizer._rigid_load_state_dict``).

Every rank runs :func:`preflight` first (names, sizes, zip directories, every record's CRC-32, and
the small model-states file for the rank count), so that all ranks stop together with the same
line; what only the load itself finds is diagnosed after it fails, from the error and the files'
names. The CRC check of the checkpoint's files is shared out: each rank reads the files it is
about to load (which leaves them in the page cache for the load) and the ranks tell each other
what they found.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

from engine.errors import CheckpointError

_SHAPE = re.compile(
    r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\([^)]*\)) from checkpoint, "
    r"the shape in current model is (torch\.Size\([^)]*\))"
)
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
    _LOADING["folder"] = None
    named_by_latest = tag is None
    tag = _tag(load_dir, tag)
    if tag is None:
        raise _EveryRank(
            f"checkpoint {load_dir} has no 'latest' file naming a tag: pass the tag to load_checkpoint, or check the directory"
        )
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        tags = _tags_in(load_dir)
        if named_by_latest:
            raise _EveryRank(
                f"checkpoint {load_dir}'s 'latest' file names tag {tag!r}, which is not there (tags "
                f"there: {tags or 'none'}): write the tag to resume from into "
                f"{os.path.join(load_dir, 'latest')}, or pass it to load_checkpoint"
            )
        raise _EveryRank(f"checkpoint {folder} does not exist: check the path and tag (tags in {load_dir}: {tags or 'none'})")
    if universal:  # another layout (zero/<param>/...), loaded at any rank count: DeepSpeed checks it
        bad = _agreed(_damaged_records(folder, recursive=True))
        if bad:
            raise _EveryRank(bad)
        return
    bad = _damaged_file(folder) or _agreed(_damaged_records(folder, recursive=False))
    if bad:
        raise _EveryRank(bad)
    _LOADING["folder"] = folder
    model_files = sorted(glob.glob(os.path.join(folder, "*mp_rank_00_model_states.pt")))
    if not model_files:
        raise _EveryRank(
            f"checkpoint {folder} has no model states file (*mp_rank_00_model_states.pt): it is not a "
            f"DeepSpeed checkpoint, or it was not saved completely"
        )
    import torch

    saved = int(torch.load(model_files[0], map_location="cpu", weights_only=False).get("dp_world_size") or 1)
    for kind in ("model_states", "optim_states"):
        present = {
            int(m.group(1))
            for f in glob.glob(os.path.join(folder, f"*zero_pp_rank_*_mp_rank_00_{kind}.pt"))
            if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)))
        }
        gone = sorted(set(range(saved)) - present)
        if gone and (present or kind == "optim_states"):
            raise _EveryRank(
                f"checkpoint {folder} was saved by {saved} ranks and lacks the {kind} file of rank(s) "
                f"{gone}: copy the missing files from where it was saved, or resume from another "
                f"checkpoint"
            )
    if optimizer_states and saved != world_size:
        raise _EveryRank(
            f"checkpoint {folder} was saved by {saved} ranks and this run has {world_size}: run with "
            f"{saved} ranks, or convert it with `python -m deepspeed.checkpoint.ds_to_universal` and "
            f'set "checkpoint": {{"load_universal": true}} in the ds_config'
        )
    bad = _agreed(_mixed_saves(folder, optimizer_states=optimizer_states))
    if bad:
        raise _EveryRank(bad)


_LOADING: dict = {"folder": None}
"""The checkpoint folder this process's last :func:`preflight` passed (None: a universal one, or
none yet): the engine's optimizer checks its files against this run's model as it loads them."""


def loading_folder() -> str | None:
    """The folder of the checkpoint being loaded, as :func:`preflight` found it (None: unknown)."""
    return _LOADING["folder"]


def rank_optimizer_file(folder: str, rank: int) -> str:
    """Rank ``rank``'s optimizer states file in ``folder`` (DeepSpeed's name, bf16_ prefixed or not)."""
    return _rank_file(folder, rank, "optim_states") or os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _shape(s) -> str:
    """A shape as torch prints it, as in :func:`describe_failure`'s line (torch's own size mismatch)."""
    return "torch.Size([" + ", ".join(str(int(d)) for d in s) + "])"


def another_model(folder: str, rank: int, current: list[list[tuple[int, ...]]]) -> str | None:
    """One line where the checkpoint in ``folder`` holds another model than this run's: the
    ``param_shapes`` its model states file keeps (each optimized parameter's name and full shape,
    by param group, in the order of the optimizer's flat partitions) against ``current``, this
    run's shapes in the same order. ZeRO-3 partitions every parameter, so two models can give
    each rank the same partition sizes, or not: the shapes say which parameter differs. None
    where they agree, or where the file keeps no shapes."""
    import torch

    model = _rank_file(folder, rank, "model_states") or next(
        iter(sorted(glob.glob(os.path.join(folder, "*mp_rank_00_model_states.pt")))), None
    )
    if model is None:
        return None
    try:
        saved = torch.load(model, map_location="cpu", mmap=True, weights_only=False).get("param_shapes")
        theirs = [(str(name), tuple(int(d) for d in shape)) for group in saved for name, shape in group.items()]
    except Exception:  # noqa: BLE001 - no shapes to compare (an older save): the sizes are checked next
        return None
    mine = [tuple(int(d) for d in s) for group in current for s in group]
    fix = "load a checkpoint of this model, or check the script's model arguments"
    for (name, there), here in zip(theirs, mine):
        if there != here:
            return (
                f"checkpoint file {model} holds another model: {name} is {_shape(there)} there and "
                f"{_shape(here)} here (its param_shapes); {fix}"
            )
    if len(theirs) != len(mine):
        return (
            f"checkpoint file {model} holds another model: {len(theirs)} optimized parameters there and "
            f"{len(mine)} here (its param_shapes); {fix}"
        )
    return None


class _EveryRank(CheckpointError):
    every_rank = True  # every rank raises it: the bootstrap prints it once


def refuse_on_every_rank(mine: str | None) -> None:
    """Raise, on every rank, the first rank's finding (by rank) where any rank has one: a
    collective, so every rank calls it at the same point of the load."""
    found = _agreed(mine)
    if found:
        raise _EveryRank(found)


def _tags_in(load_dir: str) -> list[str]:
    return sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d))) if os.path.isdir(load_dir) else []


def _tag(load_dir: str, tag) -> str | None:
    """``tag``, or the one ``load_dir``'s ``latest`` file names (None where there is no such
    file); a ``latest`` that names no usable tag is a :class:`CheckpointError` saying what is wrong
    with it (DeepSpeed would look for a folder of that name, and report the folder missing)."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    try:
        with open(latest, "rb") as f:
            raw = f.read(4097)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _EveryRank(
            f"checkpoint {load_dir}'s 'latest' file cannot be read ({e.strerror}): fix it, or pass the tag to load_checkpoint"
        ) from None
    fix = (
        f"write the tag to resume from into {latest} (tags there: {_tags_in(load_dir) or 'none'}), or pass it to load_checkpoint"
    )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _EveryRank(f"checkpoint {load_dir}'s 'latest' file is not text ({len(raw)} bytes, not UTF-8): {fix}") from None
    text = text.strip()  # DeepSpeed strips it too: a trailing newline is fine
    if not text:
        raise _EveryRank(f"checkpoint {load_dir}'s 'latest' file is empty: it names no tag; {fix}")
    bad = next((c for c in text if not c.isprintable() or c in "/\\"), None)
    if bad is not None or len(raw) > 4096 or text in (".", ".."):
        what = (
            "is too long to be a tag"
            if len(raw) > 4096
            else f"has {bad!r} in it"
            if bad is not None
            else "names the directory itself"
        )
        raise _EveryRank(f"checkpoint {load_dir}'s 'latest' file holds {text[:80]!r}, which is not a tag (it {what}): {fix}")
    return text


def describe_failure(load_dir: str, tag, error: BaseException) -> str:
    """One line for a load that passed :func:`preflight` and failed inside DeepSpeed: the
    checkpoint, what differs (read from the error) and the fix."""
    try:
        folder = os.path.join(load_dir, _tag(load_dir, tag) or "")
    except CheckpointError:  # 'latest' changed since the preflight read it
        folder = load_dir
    text = " ".join(str(error).split())
    gone = getattr(error, "filename", None)
    if isinstance(error, FileNotFoundError) and gone:
        return f"checkpoint {folder} lacks {gone}: copy it from where the checkpoint was saved, or resume from another checkpoint"
    m = _SHAPE.search(text)
    if m:
        return (
            f"checkpoint {folder} holds another model: {m.group(1)} is {m.group(2)} there and {m.group(3)} "
            f"here; load a checkpoint of this model"
        )
    m = _KEYS.search(text)
    if m:
        return (
            f"checkpoint {folder} holds another model: {m.group(1).lower()} {m.group(2)[:200]}; load a "
            f"checkpoint of this model (or pass load_module_strict=False)"
        )
    return f"checkpoint {folder} did not load ({type(error).__name__}: {text[:300]})"


def _damaged_file(folder: str) -> str | None:
    for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        if not zipfile.is_zipfile(path):
            return (
                f"checkpoint file {path} is truncated or damaged ({os.path.getsize(path)} bytes, not a complete "
                f"torch.save archive): restore it, or resume from another checkpoint"
            )
    return None


# -- every record's CRC-32 -------------------------------------------------------------------------
# A torch.save archive is a zip file, which stores a CRC-32 of each record (the pickle, each
# tensor's storage); torch.load never checks them, so a flipped bit loads as a wrong value.

CRC_CHUNK_BYTES = 64 << 20
"""A record is checked in pieces of this size, on as many threads as the rank has cores."""
try:  # ISA-L's CRC-32 (carry-less multiplies): about 4x zlib's on one core, the GIL released
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # zlib's: the same values, slower
    _crc32 = zlib.crc32
_POLY = 0xEDB88320  # zlib's CRC-32, bit-reflected


def _mult_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_mult_mod_p(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's (``crc1``), B's (``crc2``) and B's length (zlib's crc32_combine)."""
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _mult_mod_p(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _mult_mod_p(p, crc1) ^ crc2


def _records(f, zf: zipfile.ZipFile):
    """(name, data offset, length, stored CRC) of each record, or the ZipInfo where the record is
    compressed (torch stores them uncompressed)."""
    for info in zf.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            yield info
            continue
        f.seek(info.header_offset)
        header = f.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"no local header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        yield info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size, info.CRC


def damaged_record(path: str, threads: int | None = None) -> str | None:
    """The first record of the torch.save archive ``path`` whose bytes do not match the CRC-32 the
    archive stores for it, as ``"record NAME (CRC-32 ... stored, ... read)"``; None where every
    record matches. Reads the file once, in pieces, on ``threads`` threads (zlib drops the GIL)."""
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
        records: list[tuple[str, int, int, int]] = []
        compressed: list[zipfile.ZipInfo] = []
        for r in _records(f, zf):
            (compressed if isinstance(r, zipfile.ZipInfo) else records).append(r)
        for info in compressed:  # zipfile checks the CRC of what it inflates
            try:
                with zf.open(info) as member:
                    while member.read(CRC_CHUNK_BYTES):
                        pass
            except zipfile.BadZipFile:
                return f"record {info.filename} (its bytes do not match its CRC-32)"
        size = os.fstat(f.fileno()).st_size
        if any(offset + length > size for _, offset, length, _ in records):
            name = next(n for n, offset, length, _ in records if offset + length > size)
            return f"record {name} (it ends past the end of the file)"
        if not records or size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                pieces = [
                    (i, start, min(CRC_CHUNK_BYTES, length - (start - offset)))
                    for i, (_, offset, length, _) in enumerate(records)
                    for start in range(offset, offset + length, CRC_CHUNK_BYTES)
                ]
                crc_of = lambda piece: _crc32(view[piece[1] : piece[1] + piece[2]])  # noqa: E731
                if threads > 1 and len(pieces) > 1:
                    with ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="offloadctl-crc") as pool:
                        crcs = list(pool.map(crc_of, pieces))
                else:
                    crcs = [crc_of(p) for p in pieces]
            finally:
                view.release()
    got = [0] * len(records)
    for (i, _, length), crc in zip(pieces, crcs):
        got[i] = crc32_combine(got[i], crc, length)
    for (name, _, _, stored), crc in zip(records, got):
        if crc != stored:
            return f"record {name} (CRC-32 {stored:08x} stored, {crc:08x} read)"
    return None


def _damaged_records(folder: str, *, recursive: bool) -> str | None:
    """This rank's share of the CRC check of ``folder``'s archives: the files named for its rank
    (``zero_pp_rank_R_``, the ones it loads), the others shared out by position. One line for the
    first damaged one, or None."""
    rank, world = _rank_and_world()
    pattern = os.path.join(folder, "**", "*.pt") if recursive else os.path.join(folder, "*.pt")
    for i, path in enumerate(sorted(glob.glob(pattern, recursive=recursive))):
        m = re.match(r"zero_pp_rank_(\d+)_", os.path.basename(path))
        owner = int(m.group(1)) if m and int(m.group(1)) < world else i % world
        if owner != rank:
            continue
        try:
            bad = _saved_as_another(path)
            if bad:
                return bad
            bad = damaged_record(path)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"checkpoint file {path} is truncated or damaged ({e}): restore it, or resume from another checkpoint"
        if bad:
            return (
                f"checkpoint file {path} is damaged: {bad}; restore it from where it was saved, or resume from another checkpoint"
            )
    return None


# -- files that belong together -------------------------------------------------------------------
# Every record can pass its CRC-32 in a folder put together wrong (another rank's file copied over
# this one's, another save's optimizer states beside these model states): each file is checked for
# the name it was saved under and the step it was saved at before anything loads.

SAVED_AT_STEP = "offloadctl_global_steps"
"""The key of the engine's step (``global_steps``) in an optimizer state offloadctl's engine saves
(``OffloadZero3Optimizer.state_dict``); its model states file carries the same step."""
_DS_FILE = re.compile(r"(?:bf16_)?(?:zero_pp_rank_\d+_)?mp_rank_\d+_(?:model|optim)_states")


def _saved_as_another(path: str) -> str | None:
    """One line where the archive ``path`` was saved under another DeepSpeed file's name:
    ``torch.save`` names every record after the stem of the file it writes
    (``zero_pp_rank_0_mp_rank_00_optim_states/data.pkl``), and a copy keeps them."""
    with zipfile.ZipFile(path) as zf:
        first = next(iter(zf.namelist()), "")
    saved_as, stem = first.split("/", 1)[0], os.path.basename(path).removesuffix(".pt")
    if "/" not in first or saved_as == stem or not _DS_FILE.fullmatch(saved_as):
        return None  # the same name, or one that is not a DeepSpeed file's (saved through a stream: 'archive')
    return (
        f"checkpoint file {path} was saved as {saved_as}.pt (the name its records carry), not as "
        f"{os.path.basename(path)}: another file was copied over it; copy this one from where the checkpoint was "
        f"saved, or resume from another checkpoint"
    )


def _rank_file(folder: str, rank: int, kind: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, f"*zero_pp_rank_{rank}_mp_rank_00_{kind}.pt")))
    return found[0] if found else None


def _mixed_saves(folder: str, *, optimizer_states: bool) -> str | None:
    """One line where this rank's files of ``folder`` come from different saves: its model states
    at another step than rank 0's, or its optimizer states at another step than its model states
    (offloadctl's carry the step, :data:`SAVED_AT_STEP`; stock's only their updates, which a save
    can never have more of than its steps that were not skipped). None where they agree, or where
    a file does not unpickle (the load itself then says what is wrong)."""
    import torch

    rank, _ = _rank_and_world()
    model, first = _rank_file(folder, rank, "model_states"), _rank_file(folder, 0, "model_states")
    if model is None:
        return None
    try:
        states = {p: torch.load(p, map_location="cpu", mmap=True, weights_only=False) for p in {model, first} if p}
        steps = {p: (int(sd.get("global_steps") or 0), int(sd.get("skipped_steps") or 0)) for p, sd in states.items()}
    except Exception:  # noqa: BLE001 - not ours to diagnose here
        return None
    fix = "copy the whole folder of one save, or resume from another checkpoint"
    step, skipped = steps[model]
    if first and steps[first][0] != step:
        return (
            f"checkpoint file {model} was saved at step {step} and {first} at step {steps[first][0]}: the folder "
            f"mixes files of two saves; {fix}"
        )
    optim = _rank_file(folder, rank, "optim_states")
    if not optimizer_states or optim is None:
        return None
    try:
        osd = torch.load(optim, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
        saved_at = osd.get(SAVED_AT_STEP)
        updates = max(
            (int(s["step"]) for s in osd["optimizer_state_dict"]["state"].values() if isinstance(s, dict) and "step" in s),
            default=None,
        )
    except Exception:  # noqa: BLE001
        return None
    if saved_at is not None and int(saved_at) != step:
        return (
            f"checkpoint file {optim} was saved at step {int(saved_at)} and {model} at step {step}: the folder "
            f"mixes files of two saves; {fix}"
        )
    if saved_at is None and updates is not None and updates > step - skipped:
        return (
            f"checkpoint file {optim} holds the optimizer state after {updates} updates and {model} was saved at "
            f"step {step}: the folder mixes files of two saves; {fix}"
        )
    return None


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed(mine: str | None) -> str | None:
    """The first rank's finding (by rank), on every rank: each checked its share."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return next((f for f in found if f), None)


# -- saving ----------------------------------------------------------------------------------------


def describe_write_failure(save_dir: str, error: BaseException) -> str | None:
    """What a failed save says of the disk (``integrations.ds_patches.guard_save_checkpoint`` says
    it in one line), or None when it is not a write failure."""
    import errno

    text = str(error)
    code = getattr(error, "errno", None)
    if code is None and not any(s in text for s in ("iostream error", "file write failed", "unexpected pos", "No space left")):
        return None
    try:
        fs = os.statvfs(save_dir)
        free = fs.f_bavail * fs.f_frsize
    except OSError:
        free = None
    if code == errno.ENOSPC or (free is not None and free < (1 << 20)) or "No space left" in text:
        return f"the disk is full ({free if free is not None else 0:,} bytes free there): free space, or save elsewhere"
    if code is not None:
        return f"{os.strerror(code)}: check the disk, or save elsewhere"
    return f"writing failed ({' '.join(text.split())[:200]}): check the disk and its free space, or save elsewhere"


def partition_refusal(
    theirs: list[int] | None, mine: list[int], *, folder: str | None, rank: int, moments: dict | None
) -> str | None:
    """Why the checkpoint's optimizer state cannot load into this rank's partition (``theirs``:
    its subgroups' sizes; ``mine``: this rank's), naming this rank's optimizer file where the
    checkpoint's ``folder`` is known; with ``moments`` (the saved Adam states by subgroup), those
    too. None where it fits."""
    file = rank_optimizer_file(folder, rank) if folder is not None else None
    if theirs != mine:
        where = f" (in {file})" if file else ""
        which = next((i for i, (a, b) in enumerate(zip(theirs or [], mine)) if a != b), min(len(theirs or []), len(mine)))
        differs = (
            f"subgroup {which} has {theirs[which]} elements there and {mine[which]} here"
            if theirs and which < min(len(theirs), len(mine))
            else f"{len(theirs or [])} subgroups there and {len(mine)} here"
        )
        return (
            f"the checkpoint's optimizer state has {len(theirs or [])} subgroups of {_listed(theirs or [])} "
            f"elements{where} and rank {rank}'s partition has {len(mine)} of {_listed(mine)}: {differs}; it was "
            f"saved with another sub_group_size, model or rank count: load it with the same ones, or convert "
            f"it with ds_to_universal"
        )
    for i, n in enumerate(mine):
        saved = moments.get(i) if moments is not None else None
        if saved and any(int(saved[k].numel()) != n for k in ("exp_avg", "exp_avg_sq")):
            return (
                f"the checkpoint's moments of subgroup {i}{f' in {file}' if file else ''} do not have its {n} "
                f"elements: the file is damaged or from another run; resume from another checkpoint"
            )
    return None


def _listed(sizes: list[int]) -> str:
    return f"[{', '.join(map(str, sizes[:4]))}{', ...' if len(sizes) > 4 else ''}]"
