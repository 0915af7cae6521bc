"""The storage paths an engine swaps state to (:class:`SwapPaths`): their rates, the stripe of the
swapped subgroups over them, each subgroup's swap file, and the bytes each path moved.

A path itself (its files, its parallel O_DIRECT transfers, its limits) is
:class:`engine.storage.paths.SwapPath`; the stripe is :func:`engine.placement.stripe`'s.
``docs/engine.md`` places it among the engine's parts; the knobs that move subgroups between
paths and change a path's limits are ``docs/tuner.md``'s.
"""

from __future__ import annotations

from typing import Sequence, TypedDict

from engine.config import EngineConfig, Knobs
from engine.layout import payload_bytes
from engine.placement import Tier, round_trip_rate, stripe
from engine.storage.io_backends import open_backend
from engine.storage.paths import PathCounters, SwapFile, SwapPath, check_usable, measure_bandwidth
from engine.subgroup import Subgroup

# What the paths moved since a snapshot (:meth:`SwapPaths.moved_since`), as StepRecord names it:
# bytes per kind of path and per path, and per path its busy seconds and its requests' wait.
Moved = TypedDict(
    "Moved",
    {
        "bytes_read": dict[str, int],
        "bytes_written": dict[str, int],
        "path_bytes_read": dict[str, int],
        "path_bytes_written": dict[str, int],
        "path_read_busy_s": dict[str, float],
        "path_write_busy_s": dict[str, float],
        "path_queue_wait_s": dict[str, float],
    },
)


def depth_response(p: SwapPath, concurrency: int, node_lock: bool, at: tuple[float, float]) -> dict[str, float]:
    """``p``'s round trip with twice (``double``) and half (``half``) ``concurrency`` requests in
    flight, over its round trip ``at`` it (read and write bytes/s just probed), probed now; with
    ``at``, the concurrency the ratios were measured from. A tuner spends no trial raising a
    path's concurrency where twice the requests gained nothing here, nor lowering it on a path
    no one else shares: one probe each at start against a few iterations each in the run."""
    out: dict[str, float] = {"at": concurrency}
    base = round_trip_rate(*at)
    for name, n in (("double", min(64, 2 * concurrency)), ("half", max(1, concurrency // 2))):
        if n == concurrency or base <= 0:
            continue
        p.set_limits(concurrency=n, node_lock=node_lock)
        try:
            out[name] = round(round_trip_rate(*measure_bandwidth(p)) / base, 3)
        finally:
            p.set_limits(concurrency=concurrency, node_lock=node_lock)
    return out


class SwapPaths:
    """The engine's storage paths. Without swapped state (``host_cache_bytes`` None: everything in
    memory) none is opened, but each configured path is still checked at construction."""

    def __init__(self, config: EngineConfig, knobs: Knobs) -> None:
        self.config = config
        self.paths: list[SwapPath] = []
        self.round_trip_bytes_per_s: list[float] = []
        """Per path: a read plus a write of the same bytes, what a subgroup's round trip costs it."""
        self.read_bytes_per_s: list[float] = []
        self.depth_response: dict[str, dict[str, float]] = {}
        """Per probed path: its round trip at twice and at half its concurrency over its round trip
        at it (:func:`depth_response`): whether a tuner's concurrency trial there can gain."""
        self.io_backend: str | None = None
        if config.paths and config.host_cache_bytes is not None:
            backend = open_backend(config.io_backend)
            self.io_backend = backend.name
            self.paths = [
                SwapPath(
                    spec,
                    backend,
                    concurrency=knobs.concurrency_for(spec.path),
                    node_lock=knobs.node_lock,
                    verify_checksums=config.verify_checksums,
                    rank=config.rank,
                )
                for spec in config.paths
            ]
            rates = [self._rates_of(p, knobs) for p in self.paths]
            self.read_bytes_per_s = [r for r, _ in rates]
            self.round_trip_bytes_per_s = [round_trip_rate(r, w) for r, w in rates]
        else:
            for spec in config.paths:  # unused, but a bad path is still an error at construction
                check_usable(spec.path)

    def _rates_of(self, p: SwapPath, knobs: Knobs) -> tuple[float, float]:
        """Read and write bytes/s of a path: declared, else probed now (and how the probe's rate
        answers the requests in flight); within its cap."""
        r, w = p.spec.read_bytes_per_s, p.spec.write_bytes_per_s
        if r is None or w is None:
            mr, mw = measure_bandwidth(p)
            if not p.spec.cap_bytes_per_s:  # a cap paces the path whatever is in flight: nothing to learn
                self.depth_response[p.path] = depth_response(p, knobs.concurrency_for(p.path), knobs.node_lock, (mr, mw))
            r, w = r or mr, w or mw
        if p.spec.cap_bytes_per_s:
            r, w = min(r, p.spec.cap_bytes_per_s), min(w, p.spec.cap_bytes_per_s)
        return r, w

    def stripe_weights(self, knobs: Knobs) -> list[float]:
        """Each path's share of the swapped bytes under ``knobs``: its weight, else its round trip rate."""
        return [knobs.stripe_weights.get(p.path, bw) for p, bw in zip(self.paths, self.round_trip_bytes_per_s)]

    def check_room(self, tiers: Sequence[Tier], numels: Sequence[int]) -> None:
        """StoragePathError where a path has less free space than the swap files this rank is
        about to allocate there: said before the first, with the whole size the run needs there
        and the options that change it (rather than the one file that did not fit)."""
        from engine.errors import StoragePathError
        from engine.layout import HEADER_BYTES
        from engine.units import format_size, size_at_least

        need = [0] * len(self.paths)
        for tier, numel in zip(tiers, numels):
            if tier.path_index is not None:  # swapped
                need[tier.path_index] += HEADER_BYTES + payload_bytes(numel)
        for p, n in zip(self.paths, need):
            free = p.free_bytes()
            if n > free:
                cache = self.config.host_cache_bytes or 0
                raise StoragePathError(
                    f"storage path {p.path} is full for this run: this rank's swap files there need "
                    f"{format_size(n)} and it has {format_size(free)} free; free space there, add another path "
                    f"(--nvme), or keep more state in host memory: --host-cache {size_at_least(cache + n - free)} "
                    f"or more (host_cache_bytes, now {format_size(cache)})"
                )

    def create_file(self, index: int, numel: int, path_index: int) -> SwapFile:
        """Subgroup ``index``'s swap file (``numel`` elements) on path ``path_index``."""
        return self.paths[path_index].create_file(index, numel, payload_bytes(numel), self.config.io_chunk_bytes)

    def check_stripe(self, subgroups: Sequence[Subgroup], knobs: Knobs, in_force: Knobs) -> None:
        """Raise :class:`ConfigError` if ``knobs`` would stripe the swapped subgroups where they
        cannot go (weights no path can take)."""
        swapped = [payload_bytes(sg.numel) for sg in subgroups if sg.tier.swapped]
        if swapped and self.stripe_weights(knobs) != self.stripe_weights(in_force):
            stripe(swapped, self.stripe_weights(knobs))

    def set_limits(self, knobs: Knobs) -> None:
        """Each path's concurrency and node lock as ``knobs`` say."""
        for p in self.paths:
            p.set_limits(concurrency=knobs.concurrency_for(p.path), node_lock=knobs.node_lock)

    def restripe(self, subgroups: Sequence[Subgroup], knobs: Knobs, old: Knobs) -> None:
        """Where ``knobs`` weigh the paths otherwise than ``old``, move swapped subgroups to their new
        paths lazily: each goes at its next write."""
        if self.stripe_weights(knobs) == self.stripe_weights(old):
            return
        swapped = [sg for sg in subgroups if sg.tier.swapped]
        targets = stripe([payload_bytes(sg.numel) for sg in swapped], self.stripe_weights(knobs))
        for sg, p in zip(swapped, targets):
            if p == sg.tier.path_index:
                continue
            home = sg.swap
            if home.next_file is not None:
                home.next_file.path.remove_file(home.next_file)
                home.next_file = None
            home.path_index = p
            if home.file.path is self.paths[p]:
                continue  # back on the path that holds its state (a move not yet done): nothing to move
            if sg.fresh:  # nothing on storage yet: move the empty file now
                home.file.path.remove_file(home.file)
                home.file = self.create_file(sg.index, sg.numel, p)
            else:
                home.next_file = self.create_file(sg.index, sg.numel, p)

    def counters(self) -> list[PathCounters]:
        """Each path's counters so far (bytes, busy times, queue wait)."""
        return [p.snapshot() for p in self.paths]

    def moved_since(self, before: list[PathCounters]) -> Moved:
        """What moved since :meth:`counters` gave ``before``: bytes read and written per kind of
        path (``bytes_read``, ``bytes_written``) and per path (``path_bytes_read``,
        ``path_bytes_written``), and per path the seconds it was busy reading and writing and its
        requests waited for a slot (``path_read_busy_s``, ``path_write_busy_s``,
        ``path_queue_wait_s``), as :class:`engine.telemetry.StepRecord` names them."""
        moved: Moved = {
            "bytes_read": {},
            "bytes_written": {},
            "path_bytes_read": {},
            "path_bytes_written": {},
            "path_read_busy_s": {},
            "path_write_busy_s": {},
            "path_queue_wait_s": {},
        }
        for p, b in zip(self.paths, before):
            c = p.snapshot()
            read, written = c.bytes_read - b.bytes_read, c.bytes_written - b.bytes_written
            moved["path_bytes_read"][p.path], moved["path_bytes_written"][p.path] = read, written
            moved["path_read_busy_s"][p.path] = round(c.read_busy_s - b.read_busy_s, 6)
            moved["path_write_busy_s"][p.path] = round(c.write_busy_s - b.write_busy_s, 6)
            moved["path_queue_wait_s"][p.path] = round(c.queue_wait_s - b.queue_wait_s, 6)
            moved["bytes_read"][p.spec.kind] = moved["bytes_read"].get(p.spec.kind, 0) + read
            moved["bytes_written"][p.spec.kind] = moved["bytes_written"].get(p.spec.kind, 0) + written
        return moved

    def close(self) -> None:
        for p in self.paths:
            p.close()
