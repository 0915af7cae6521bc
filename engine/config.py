"""Configuration owned by the engine: storage paths, engine settings, and the live knobs.

Each dataclass validates itself at construction and raises :class:`ConfigError` naming the
field. Units are in the field names.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, Iterable, Literal, Mapping, Sequence

from engine.errors import ConfigError

TierKind = Literal["nvme", "remote"]


@dataclass(frozen=True, kw_only=True)
class StoragePath:
    """A directory that holds swap files for one storage tier."""

    path: str
    """Directory for swap files. Must exist, be writable, and support O_DIRECT."""
    kind: TierKind = "nvme"
    """``nvme`` for node-local storage, ``remote`` for a parallel file system."""
    read_bytes_per_s: float | None = None
    """Declared sequential read bandwidth. None: measured by a quick probe at start."""
    write_bytes_per_s: float | None = None
    """Declared sequential write bandwidth. None: measured by a quick probe at start."""
    cap_bytes_per_s: float | None = None
    """Upper limit on this process's traffic to the path (reads and writes each), for shared
    file systems. None: no cap."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError(f"StoragePath.path must be a directory path, got {self.path!r}")
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        if self.kind not in ("nvme", "remote"):
            raise ConfigError(f"StoragePath.kind for {self.path} must be 'nvme' or 'remote', got {self.kind!r}")
        for name in ("read_bytes_per_s", "write_bytes_per_s", "cap_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"StoragePath.{name} for {self.path} must be a positive number, got {v!r}")

    @classmethod
    def coerce(cls, value: "str | os.PathLike[str] | StoragePath", kind: TierKind) -> "StoragePath":
        if isinstance(value, StoragePath):
            return value if value.kind == kind else replace(value, kind=kind)
        return cls(path=os.fspath(value), kind=kind)


def storage_paths(
    nvme: Iterable[str | os.PathLike[str] | StoragePath] = (), remote: Iterable[str | os.PathLike[str] | StoragePath] = ()
) -> tuple[StoragePath, ...]:
    """The storage tiers' paths, node-local (``nvme``) first, then ``remote``: the one rule for
    ``OffloadAdamW``, the DeepSpeed integration and ``offloadctl train``. A :class:`StoragePath`
    given keeps its declared figures and takes its tier's kind."""
    return tuple(StoragePath.coerce(p, "nvme") for p in nvme) + tuple(StoragePath.coerce(p, "remote") for p in remote)


def resolve_host_cache(host_cache_bytes: int | None, paths: Sequence[StoragePath]) -> int | None:
    """How much optimizer state a user's budget keeps in host memory: the one rule, for
    ``OffloadAdamW`` and ``offloadctl train`` alike (a profile's plan gives its own budget).

    - A budget given is the budget (state beyond it goes to the paths; with no paths, a budget
      the state does not fit is an error at placement, naming the fix).
    - None with storage paths: 0. Paths are given to hold the state, so it goes there and host
      memory holds only the staging buffers; keep some in memory with a budget.
    - None without paths: None, all of it in host memory (there is nowhere else).
    """
    if host_cache_bytes is not None:
        return host_cache_bytes
    return 0 if paths else None


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Settings fixed for the engine's lifetime."""

    subgroup_numel: int = 10_000_000
    """Target elements per subgroup. Larger: fewer, longer I/O requests; smaller: finer
    placement and earlier overlap. Each subgroup holds 12 bytes of state per element."""
    host_cache_bytes: int | None = None
    """Budget for optimizer state that stays in host memory. None: all of it. The adapters
    (``OffloadAdamW``, ``offloadctl train``) read a user's budget through
    :func:`resolve_host_cache` first, so for users None with paths means none of it; None here
    is what a plan that keeps everything in memory says. The swap staging buffers
    (``2 * prefetch_depth + 3`` subgroups) come on top of it."""
    device_cache_bytes: int | None = 0
    """Budget for optimizer state that stays in device memory (updated there, no transfers).
    None: as much as the device has free after the first forward/backward, less a safety
    margin (``engine.gpumem``)."""
    auto_device_fraction: bool = False
    """At the first step, set ``Knobs.device_fraction`` so that the host lane and the device
    lane's PCIe copies finish together (measured host-lane and pinned PCIe rates)."""
    paths: tuple[StoragePath, ...] = ()
    """NVMe and remote paths, striped in proportion to their bandwidth."""
    device: str | None = None
    """Device of the device lane: 'cuda', 'cuda:N', or 'cpu' (tests). None: the current CUDA
    device when CUDA is present, else no device lane."""
    io_backend: Literal["auto", "aio", "posix"] = "auto"
    """'aio': DeepSpeed's async_io op; 'posix': O_DIRECT preadv/pwritev on a thread pool;
    'auto': aio when it loads, else posix."""
    io_chunk_bytes: int = 8 << 20
    """Size of one I/O request. A subgroup's transfer is split into chunks that run in
    parallel up to the path's concurrency."""
    host_adam: Literal["auto", "fastest", "torch", "deepspeed"] = "auto"
    """Host-lane AdamW kernel. 'auto': without a device lane, DeepSpeed's cpu_adam where the op is
    built (stock's: the losses are stock's bit for bit), else torch's; with one, 'fastest': the
    faster lane on this machine, measured once and kept (:mod:`engine.host_kernel`)."""
    verify_checksums: bool = True
    """Check each swap file's CRC32 on read. Costs about 0.4 s per GB of one core (zlib, 2.7 GB/s
    measured on this project's CI machine), in the I/O threads."""
    io_cores: int = 1
    """Cores left to the I/O threads (checksums, system calls) during a step with state on
    storage: the host lane runs on the others (``torch.set_num_threads`` for the step), so that
    its OpenMP threads, which run at the pace of the slowest, never share a core with a checksum.
    0: the host lane takes every core. Steps without swapped state use every core either way."""
    run_dir: str | None = None
    """If set, one telemetry record per step is appended to ``run_dir/telemetry-rank<R>.jsonl``."""
    rank: int = 0
    """Rank of this process, used in file and telemetry names."""
    local_ranks: int = 1
    """Ranks on this node: they share its host memory bandwidth, which the lane balance divides,
    and its memory, which the default host budget divides."""
    host_memory_bytes: int | None = None
    """Budget for everything the engine holds in host memory: host-tier state, staging buffers
    (working and kept), copies (``engine.host_memory``). None: a share of the memory available
    at start divided among ``local_ranks``, raised to what the start needs. A budget given that
    the start does not fit is a ConfigError naming the fix."""
    host_memory_floor_bytes: int | None = None
    """Available memory on the machine below which the engine gives back its kept and read-ahead
    buffers. None: ``engine.host_memory.default_floor()`` (5% of memory, at least 1 GiB)."""
    overlap_io: bool = True
    """Overlap state I/O with forward and backward: a step's write-backs drain behind it, and the
    next step's first reads start at its end and as writes land (``engine.transfers``). False: a step
    returns when its writes have landed and reads nothing ahead."""
    read_ahead_bytes: int | None = None
    """Host memory for reading ahead beyond the working staging buffers, in whole buffers. None:
    what the paths can read during one forward and backward, measured at the second step
    (``engine.layout.read_ahead_bytes``), within the host memory budget. 0: the working buffers only."""
    pins: Mapping[str, Any] = field(default_factory=dict)
    """The user's pins: :class:`KnobKey` text -> value (``{"prefetch_depth": 1}``, or
    ``{"io_concurrency[PATH]": 8}`` for one path). The engine reports them, and a tuner holds them
    from the start, never moving them."""

    def __post_init__(self) -> None:
        _positive_int("subgroup_numel", self.subgroup_numel)
        _positive_int("local_ranks", self.local_ranks)
        _non_negative_int("io_cores", self.io_cores)
        if self.host_cache_bytes is not None:
            _non_negative_int("host_cache_bytes", self.host_cache_bytes)
        if self.device_cache_bytes is not None:
            _non_negative_int("device_cache_bytes", self.device_cache_bytes)
        for name in ("host_memory_bytes", "host_memory_floor_bytes", "read_ahead_bytes"):
            if getattr(self, name) is not None:
                _non_negative_int(name, getattr(self, name))
        object.__setattr__(self, "pins", dict(self.pins))
        if not all(isinstance(key, str) for key in self.pins):
            raise ConfigError(f"pins must map knob names as text to values, got {self.pins!r}")
        if self.io_backend not in ("auto", "aio", "posix"):
            raise ConfigError(f"io_backend must be 'auto', 'aio' or 'posix', got {self.io_backend!r}")
        if self.host_adam not in ("auto", "fastest", "torch", "deepspeed"):
            raise ConfigError(f"host_adam must be 'auto', 'fastest', 'torch' or 'deepspeed', got {self.host_adam!r}")
        _positive_int("io_chunk_bytes", self.io_chunk_bytes)
        if self.io_chunk_bytes % 4096:
            raise ConfigError(f"io_chunk_bytes must be a multiple of 4096 (O_DIRECT), got {self.io_chunk_bytes}")
        seen = set()
        for p in self.paths:
            if p.path in seen:
                raise ConfigError(f"storage path {p.path} is given twice; give each directory once")
            seen.add(p.path)


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """What may change between iterations. Applied at the start of the next ``step()``.

    This is the surface the tuner drives: ``engine.set_knobs(knobs.replace(...))``.
    """

    device_fraction: float = 0.0
    """Fraction of subgroups updated on the device lane, spread evenly over the order so that
    their transfers overlap host-lane updates (Deep Optimizer States). 0 with no device."""
    prefetch_depth: int = 2
    """Subgroups read ahead of the one being updated. Staging buffers: 2 * depth + 3 (depth + 2
    working, depth + 1 kept across the step boundary for the alternating order)."""
    io_concurrency: Mapping[str, int] = field(default_factory=dict)
    """Per path (by directory): I/O requests in flight at once. Missing paths: 4."""
    node_lock: bool = False
    """One process at a time per storage device on this node, so that ranks do not interleave
    their requests on a shared disk."""
    stripe_weights: Mapping[str, float] = field(default_factory=dict)
    """Per path: relative share of swapped subgroups. Missing paths: their measured bandwidth."""

    def __post_init__(self) -> None:
        f = self.device_fraction
        if not (isinstance(f, (int, float)) and 0.0 <= f <= 1.0):
            raise ConfigError(f"Knobs.device_fraction must be in [0, 1], got {f!r}")
        _non_negative_int("Knobs.prefetch_depth", self.prefetch_depth)
        if self.prefetch_depth > 64:
            raise ConfigError(f"Knobs.prefetch_depth must be at most 64, got {self.prefetch_depth}")
        for path, n in dict(self.io_concurrency).items():
            if not (isinstance(n, int) and 1 <= n <= 64):
                raise ConfigError(f"Knobs.io_concurrency[{path!r}] must be an integer in 1..64, got {n!r}")
        for path, w in dict(self.stripe_weights).items():
            if not (isinstance(w, (int, float)) and w >= 0 and math.isfinite(w)):
                raise ConfigError(f"Knobs.stripe_weights[{path!r}] must be a non-negative number, got {w!r}")
        object.__setattr__(self, "io_concurrency", dict(self.io_concurrency))
        object.__setattr__(self, "stripe_weights", dict(self.stripe_weights))

    DEFAULT_IO_CONCURRENCY: ClassVar[int] = 4
    PER_PATH: ClassVar[tuple[str, ...]] = ("io_concurrency", "stripe_weights")
    """The knobs that map a storage path to a value."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The knob names, in field order: the one list the tuner, its protocol and the CLI use."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Knobs":
        """Knobs from a dict (JSON, a profile, a history row). Unknown names are a ConfigError."""
        unknown = set(d) - set(cls.names())
        if unknown:
            raise ConfigError(f"unknown knob(s) {sorted(unknown)}: the knobs are {', '.join(cls.names())}")
        return cls(**d)

    def concurrency_for(self, path: str) -> int:
        return self.io_concurrency.get(path, self.DEFAULT_IO_CONCURRENCY)

    def check_for(self, paths: Iterable[str], has_device: bool) -> None:
        """The checks that need the run: per-path knobs name only its storage paths, some path
        has a positive stripe weight, and a device fraction needs a device lane. ConfigError
        naming the knob.

        The engine makes them in ``set_knobs``; the tuner makes the same ones before it
        pushes a change, so that no rank refuses what the others accepted."""
        known = set(paths)
        for name in self.PER_PATH:
            unknown = set(getattr(self, name)) - known
            if unknown:
                raise ConfigError(
                    f"Knobs.{name} names {sorted(unknown)}, which are not storage paths of this run "
                    f"(paths: {sorted(known) or 'none'})"
                )
        if self.device_fraction > 0 and not has_device:
            raise ConfigError(
                "Knobs.device_fraction > 0 needs a device lane (CUDA, or device='cpu' in tests), and this run has none"
            )
        if known and all(self.stripe_weights.get(p, 1.0) == 0 for p in known):
            raise ConfigError(
                "Knobs.stripe_weights gives every storage path weight 0, so swapped state would have "
                "nowhere to go: give at least one path a weight > 0"
            )

    def replace(self, **changes: Any) -> "Knobs":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KnobKey:
    """A knob as text names it: the whole knob (``path`` None), or one path's entry of a per-path
    knob. ``str()`` and :meth:`parse` are the one spelling of knob text ('prefetch_depth',
    'io_concurrency[/nvme0]'), for pins, logs, records, the wire and the CLI."""

    name: str
    path: str | None = None

    PATH_KNOB: ClassVar[str] = "io_concurrency"
    """The one knob pinned per path (stripe weights are shares: they are given as a whole)."""
    PATH_FORM: ClassVar[str] = "io_concurrency[PATH]"
    """How messages name one path's knob."""

    def __str__(self) -> str:
        return self.name if self.path is None else f"{self.name}[{self.path}]"

    @classmethod
    def parse(cls, text: str, paths: Sequence[str] | None = None) -> "KnobKey":
        """``'prefetch_depth'`` -> KnobKey('prefetch_depth'); ``'io_concurrency[/nvme0]'`` ->
        KnobKey('io_concurrency', '/nvme0'). Only :attr:`PATH_KNOB` takes a [PATH]; with ``paths``,
        it must be one of them. ConfigError naming the text otherwise."""
        name, path = split_key(text) if isinstance(text, str) else (text, None)
        if name not in Knobs.names():
            near = nearest_knob(name) if isinstance(name, str) else None
            raise ConfigError(
                f"unknown knob {text!r}{f' (did you mean {near}?)' if near else ''}: use one of "
                f"{', '.join(Knobs.names())}, or {cls.PATH_FORM}"
            )
        if path is not None:
            if name != cls.PATH_KNOB:
                raise ConfigError(f"knob {text!r}: only {cls.PATH_KNOB} takes a [PATH]; give {name} as a whole")
            if paths is not None and path not in paths:
                raise ConfigError(f"knob {text!r} names a path this run does not use (paths: {list(paths)})")
        return cls(name, path)

    @staticmethod
    def pattern() -> str:
        """A regular expression for knob text, whole or within larger text (the wire's check, the
        CLI's ``RUN:KNOB=VALUE``)."""
        return r"(%s)(\[.+\])?" % "|".join(Knobs.names())

    def value_in(self, knobs: Knobs) -> Any:
        """This knob's value in ``knobs`` (a path's concurrency: its entry, or the default)."""
        if self.path is not None:
            return knobs.concurrency_for(self.path)
        value = getattr(knobs, self.name)
        return dict(value) if isinstance(value, Mapping) else value


def split_key(text: str) -> tuple[str, str | None]:
    """``'io_concurrency[/nvme0]'`` -> ('io_concurrency', '/nvme0'); ``'prefetch_depth'`` ->
    ('prefetch_depth', None). The spelling only: :meth:`KnobKey.parse` checks the names."""
    if text.endswith("]") and "[" in text:
        name, path = text[:-1].split("[", 1)
        return name, path
    return text, None


def nearest_knob(name: str) -> str | None:
    """The knob name closest to a mistyped ``name`` ('prefech_depth' -> 'prefetch_depth'), or
    None when none is close (or ``name`` is one)."""
    import difflib

    if name in Knobs.names():  # not mistyped: whatever is wrong is elsewhere
        return None
    near = difflib.get_close_matches(name.strip().lower(), Knobs.names(), n=1, cutoff=0.6)
    return near[0] if near else None


def typed_knob(text: str) -> str:
    """The knob name in what a user typed: before '=' and any '[PATH]', after the last ':'
    (``RUN:prefech_depth=4`` -> 'prefech_depth')."""
    head = text.split("=", 1)[0].split("[", 1)[0]
    return head.rsplit(":", 1)[-1].strip()


def _positive_int(name: str, v: object) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def _non_negative_int(name: str, v: object) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise ConfigError(f"{name} must be a non-negative integer, got {v!r}")
