"""Issue 41: the tuner sees each path's rate as it is now, takes a path that slows or comes back
for a change of conditions, and moves straight to the stripe that balances the paths, judged on
the steps that follow.

A scripted run of two storage paths: each iteration moves ``BYTES`` (half read, half written)
split by the stripe in force, the paths work in parallel, and the iteration is the compute plus
the slowest path's time. Each path's measured rates carry seeded noise, as the engine's busy-time
rates do (``StepRecord.path_*_busy_s``).
"""

from __future__ import annotations

import os
import random
import re
import statistics

import pytest

from engine.config import Knobs
from tuner.conditions import Conditions, balanced_stripe, io_time, restripe
from tuner.policy import Observation, Policy, PolicyConfig
from tuner.run_state import RunFacts

A, B = "/nvme0", "/nvme1"
BYTES = 1.2e9  # per iteration, all paths
COMPUTE_S = 0.5
FAST = 300e6


class TwoPaths:
    """A run whose paths' read and write rates are ``rates(i)``, per path, at iteration ``i``."""

    def __init__(
        self,
        policy: Policy,
        rates,
        *,
        noise: float = 0.03,
        seed: int = 0,
        conc_speedup: float = 1.0,
        others=lambda i: {},
        seen=lambda i: {},
    ) -> None:
        self.policy, self.rates, self.noise, self.others = policy, rates, noise, others
        self.seen = seen  # per path, a factor on the measured rates alone: a regime the step does not wait on
        self.rnd = random.Random(seed)
        self.knobs = policy.knobs
        self.conc_speedup = conc_speedup
        self.times: list[float] = []
        self.in_force: list[Knobs] = []
        self.decisions: list[tuple[int, Knobs, str]] = []

    def shares(self, k: Knobs) -> dict[str, float]:
        w = k.stripe_weights or {A: 1.0, B: 1.0}  # the engine's default: equal probed rates
        return {p: w[p] / sum(w.values()) for p in (A, B)}

    def path_rate(self, k: Knobs, p: str, i: int) -> float:
        """A path serves faster with more requests in flight when ``conc_speedup`` > 1 (ours, not a
        change of conditions)."""
        return self.rates(i)[p] * (self.conc_speedup if k.concurrency_for(p) > 4 else 1.0)

    def step(self) -> None:
        i, k = len(self.times), self.knobs
        shares = self.shares(k)
        rate = {p: self.path_rate(k, p, i) for p in (A, B)}
        io = max(shares[p] * BYTES / rate[p] for p in (A, B))  # a round trip: half read, half written, at `rate` each
        it = (COMPUTE_S + io) * self.rnd.lognormvariate(0, self.noise)
        n = {p: self.rnd.lognormvariate(0, self.noise) * self.seen(i).get(p, 1.0) for p in (A, B)}
        obs = Observation(
            iteration=i,
            iter_time_s=it,
            update_s=it - 0.2,
            read_wait_s=0.6 * io,
            write_wait_s=0.1 * io,
            path_read_bytes_per_s={p: shares[p] * BYTES / 2 / it for p in (A, B)},
            path_write_bytes_per_s={p: shares[p] * BYTES / 2 / it for p in (A, B)},
            path_read_rate={p: 2 * rate[p] * n[p] for p in (A, B)},
            path_write_rate={p: 2 * rate[p] * n[p] for p in (A, B)},
            knobs=k.to_dict(),
            path_other_bytes_per_s=self.others(i),
        )
        self.times.append(it)
        self.in_force.append(k)
        d = self.policy.observe(obs)
        if d is not None:
            self.decisions.append((i, d.knobs, d.reason))
            self.knobs = d.knobs

    def run(self, n: int) -> "TwoPaths":
        for _ in range(n):
            self.step()
        return self

    def median(self, a: int, b: int) -> float:
        return statistics.median(self.times[a:b])

    def slow_share(self, i: int, p: str = B) -> float:
        return self.shares(self.in_force[i])[p]


def policy(**facts) -> Policy:
    return Policy(
        Knobs(prefetch_depth=2), RunFacts(paths=(A, B), subgroup_bytes=120_000_000, pins={"prefetch_depth": 2}, **facts)
    )


def slows(at: int, back: int | None = None, factor: float = 5.0):
    return lambda i: {A: FAST, B: FAST / factor if i >= at and (back is None or i < back) else FAST}


def static_time(slow_share: float, factor: float = 5.0) -> float:
    """Iteration time with the slow path at ``slow_share``: what a static stripe would run at."""
    return COMPUTE_S + max((1 - slow_share) * BYTES / FAST, slow_share * BYTES / (FAST / factor))


def test_a_path_that_slows_is_given_its_share_at_once_and_the_tuner_says_why():
    """(a) of the issue: one of two equal paths slows 5x at iteration 40 and stays slow. Within 10
    iterations the slow path carries about a sixth of the bytes (the balance at 300 and 60 MB/s),
    in one model-guided move whose reason names the path, its rates and the weights; the steady
    time after it is within 1.25x of the best static stripe's, and far below frozen's. The search
    had run out of moves before the change: that no longer blocks one after it."""
    sim = TwoPaths(policy(), slows(40)).run(80)
    assert any("no move left to try" in e["reason"] for e in sim.policy.log if e["iteration"] < 40)
    model = [d for d in sim.decisions if d[0] >= 40 and "balances the paths" in d[2]]
    assert model, sim.decisions
    i, knobs, reason = model[0]
    assert i < 40 + 10
    said = re.search(
        rf"path {B} slowed: reads (\d+) -> (\d+) MB/s, writes (\d+) -> (\d+) MB/s: stripe weight {B} "
        "0.5 -> 0.17",
        reason,
    )
    assert said and all(abs(int(said[k]) - 600) <= 30 and abs(int(said[k + 1]) - 120) <= 6 for k in (1, 3)), reason
    assert all(0.12 <= sim.slow_share(j) <= 0.22 for j in range(i + 1, 80))
    best = min(static_time(w) for w in (0.5, 0.3, 0.17, 0.1))
    steady = sim.median(50, 80)
    assert steady <= 1.25 * best, (steady, best)
    assert static_time(0.5) / steady >= 1.5  # frozen: half the bytes stay on the slow path
    kept = [e for e in sim.policy.log if e["iteration"] > i and e["reason"].startswith("kept stripe weight")]
    assert kept and "iteration" in kept[0]["reason"]  # its measured effect, in the log
    # Settled: the I/O knobs wait for the next re-exploration; nothing moves after the kept move.
    assert "the stripe balances the paths at their rates now" in kept[0]["reason"]
    assert "the stripe balances the paths" in sim.policy.state()["holding_reason"]
    assert not [d for d in sim.decisions if d[0] > kept[0]["iteration"]], sim.decisions


def test_the_stripe_returns_when_the_path_comes_back():
    """(b): the path recovers at iteration 60; within 10 iterations the stripe is back near even and
    the time within 5% of the frozen run's before the change."""
    sim = TwoPaths(policy(), slows(30, back=60)).run(100)
    back = [d for d in sim.decisions if d[0] >= 60 and re.search(rf"path {B} sped up: reads 1\d\d -> [56]\d\d MB/s", d[2])]
    assert back and back[0][0] <= 60 + 10, sim.decisions
    assert 0.4 <= sim.slow_share(75) <= 0.6
    assert sim.median(75, 100) <= 1.05 * sim.median(10, 30)


def test_rate_noise_alone_is_no_change_of_conditions():
    """(d): equal quiet paths, 5% noise on each rate: no change is seen and no model move is made."""
    sim = TwoPaths(policy(), lambda i: {A: FAST, B: FAST}, noise=0.05, seed=3).run(80)
    assert not [e for e in sim.policy.log if e["kind"] in ("model", "conditions")], sim.policy.log


def test_a_rate_our_own_knobs_moved_is_not_a_change():
    """A path that serves faster because its concurrency was raised (more requests in flight) has
    its reference measured again; the same jump under the same knobs is a change after
    ``change_iters`` iterations."""
    cfg = PolicyConfig()
    c = Conditions([A], cfg)

    def obs(i, rate):
        return Observation(
            iteration=i,
            iter_time_s=1.0,
            update_s=1.0,
            read_wait_s=0,
            write_wait_s=0,
            path_read_rate={A: rate},
            path_write_rate={A: rate},
        )

    four, eight = Knobs(io_concurrency={A: 4}), Knobs(io_concurrency={A: 8})
    assert not any(c.track(obs(i, 600e6), four) for i in range(5))
    assert not any(c.track(obs(i, 1200e6), eight) for i in range(5, 12))  # ours: measured again
    seen = [c.track(obs(i, 240e6), eight) for i in range(12, 16)]
    assert [bool(x) for x in seen] == [False, False, True, False]
    change = seen[2][0]
    assert change.path == A and change.slowed and round(change.after_bytes_per_s / 1e6) == 120
    assert change.describe() == f"path {A} slowed: reads 1200 -> 240 MB/s, writes 1200 -> 240 MB/s"


def test_one_direction_that_moves_less_than_the_round_trip_band_is_no_change():
    """A lightly loaded path's writes read faster than its steady rate (requests meet less
    queueing): writes 300 -> 440 MB/s with reads steady moves the round trip 19%, under the 30%
    band: the writes' reference moves silently, and no move is made. Writes 300 -> 60 is a change
    of the path, said as its writes'."""
    c = Conditions([A], PolicyConfig())

    def obs(i, r, w):
        return Observation(
            iteration=i,
            iter_time_s=1.0,
            update_s=1.0,
            read_wait_s=0,
            write_wait_s=0,
            path_read_rate={A: r},
            path_write_rate={A: w},
        )

    k = Knobs()
    assert not any(c.track(obs(i, 300e6, 300e6), k) for i in range(6))
    assert not any(c.track(obs(i, 300e6, 440e6), k) for i in range(6, 12))
    seen = [x for i in range(12, 17) for x in c.track(obs(i, 300e6, 60e6), k)]
    assert len(seen) == 1 and seen[0].describe() == f"path {A} writes slowed from 440 to 60 MB/s"


def test_weight_away_from_a_contended_path_is_still_tried_after_the_model_move():
    """Another job on a path shares it by queue depth: the rate we measure there moves with how
    much we send it, so after the model's re-stripe a step of weight away from that path is still
    tried (and kept when it helps); a step away from the uncontended path is not."""

    def rates(i):
        return {A: FAST, B: FAST / 3 if i >= 20 else FAST}

    sim = TwoPaths(policy(), rates, others=lambda i: {B: 500e6} if i >= 20 else {}).run(60)
    tried = [d[2] for d in sim.decisions if d[0] > 20 and "trying stripe weight of" in d[2]]
    assert tried and all(f"stripe weight of {B}" in t for t in tried), sim.decisions


def test_a_pinned_stripe_is_not_moved_by_a_change():
    p = policy()
    p.pin("stripe_weights", {A: 0.5, B: 0.5})
    sim = TwoPaths(p, slows(20)).run(45)
    assert all(k.stripe_weights == {A: 0.5, B: 0.5} for k in sim.in_force)
    assert any(f"path {B} slowed" in e["reason"] for e in p.log)


def test_a_stripe_that_misses_the_measured_rates_at_start_is_balanced_once():
    """The engine's probe at start can be wrong (another job was on the path then): once each
    path's rate is known, a stripe far from their balance is moved there, once."""
    sim = TwoPaths(policy(), lambda i: {A: FAST, B: FAST / 4}).run(30)
    moves = [d for d in sim.decisions if "the stripe does not match the paths' measured rates" in d[2]]
    assert len(moves) == 1 and moves[0][0] <= 12  # once two windows of rates agree
    assert 0.15 <= sim.slow_share(20) <= 0.25


def test_rates_still_drifting_at_start_are_not_taken_for_the_paths():
    """A run's first iterations fill caches and queues: one path reads slow at first and comes up
    to the other's rate over a few iterations. The start's check waits for two windows of rates
    that agree, so a quiet run of two equal paths is not re-striped for its warm-up (it was, to a
    third of the bytes on the warming path, from its first three rates)."""
    sim = TwoPaths(policy(), lambda i: {A: FAST, B: FAST * min(1.0, 0.3 + 0.1 * i)}).run(30)
    assert not [d for d in sim.decisions if "the stripe does not match the paths' measured rates" in d[2]], sim.decisions
    assert all(k.stripe_weights in ({}, None) or abs(sim.shares(k)[B] - 0.5) < 0.05 for k in sim.in_force), sim.decisions


def test_the_model_balances_the_paths_times():
    rates = {A: 300e6, B: 60e6}
    w = balanced_stripe(rates, floor=0.03)
    assert abs(w[B] - 1 / 6) < 0.01 and abs(sum(w.values()) - 1) < 1e-6
    assert io_time(w, rates) < io_time({A: 0.5, B: 0.5}, rates) / 2.5  # the issue's ~2.5x (3x at these rates)
    assert balanced_stripe({A: 300e6, B: 1e6}, floor=0.03)[B] >= 0.03  # still measured
    assert restripe(rates, {A: 0.84, B: 0.16}, PolicyConfig()) is None  # already balanced: small moves refine it
    r = restripe(rates, {A: 1.0, B: 1.0}, PolicyConfig())
    assert r is not None and r.describe() == f"stripe weight {B} 0.5 -> 0.17, stripe weight {A} 0.5 -> 0.83"


@pytest.mark.slow
def test_a_real_engine_whose_path_slows_is_restriped_and_stays_exact(tmp_path):
    """The whole path on real O_DIRECT files: two paths paced at 40 MB/s each, one slowed to
    8 MB/s at iteration 8 (its pacer, as a throttled drive). The engine's busy-time rates show
    it, the policy re-stripes in one move within 10 iterations, the engine moves subgroups at their next write, and
    the slow path's share of the bytes falls to about a sixth; the parameters stay those of
    ``torch.optim.AdamW`` fed the same gradients throughout."""
    import time

    import torch
    from helpers import assert_params_close

    from engine import OffloadAdamW, StoragePath
    from tuner.observation import Observation as Obs

    dirs = [tmp_path / "p0", tmp_path / "p1"]
    for d in dirs:
        d.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(400, 400) for _ in range(6)])  # 963k params, 11.6 MB of state
    ref = torch.nn.Sequential(*[torch.nn.Linear(400, 400) for _ in range(6)])
    ref.load_state_dict(model.state_dict())
    paths = [StoragePath(path=str(d), cap_bytes_per_s=40e6) for d in dirs]
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        subgroup_numel=100_000,
        host_cache_bytes=0,
        nvme_paths=paths,
        host_adam="torch",
        read_ahead_bytes=0,
        io_backend="posix",
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    names = [p.path for p in opt.engine.swap_paths.paths]
    pol = Policy(opt.knobs, RunFacts(paths=tuple(names), subgroup_bytes=1_200_000, pins={"prefetch_depth": 2}))
    gen = torch.Generator().manual_seed(1)
    slow = opt.engine.swap_paths.paths[1]
    shares, decided = [], []
    try:
        for i in range(28):
            if i == 8:
                slow.read_pacer.cap_bytes_per_s = slow.write_pacer.cap_bytes_per_s = 8e6
            grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                for p, g in zip(m.parameters(), grads):
                    p.grad = g.clone()
                t0 = time.perf_counter()
                o.step()
                if o is opt:  # the engine's iteration: its step, not the reference's or the gradients' making
                    took = time.perf_counter() - t0
            rec = opt.telemetry[-1]
            d = pol.observe(Obs.from_records([rec], iter_times_s=[took], knobs=rec.knobs))
            moved = {p: rec.path_bytes_read.get(p, 0) + rec.path_bytes_written.get(p, 0) for p in names}
            shares.append(moved[names[1]] / max(1, sum(moved.values())))
            if d is not None:
                decided.append((i, d.reason))
                opt.set_knobs(d.knobs)
        model_moves = [(i, r) for i, r in decided if "balances the paths" in r]
        # Within the 10 iterations: a trial of the run's start (concurrency, at iteration 4 or
        # later) on the path that slows makes its rate the trial's own until it ends, so a change
        # during one is seen only after it.
        assert model_moves and 8 <= model_moves[0][0] <= 8 + 9, decided
        assert re.search(rf"path {re.escape(names[1])}( writes slowed from| slowed: )", model_moves[0][1])
        # The slow path's share of the bytes falls to the balance at the rates the policy measured
        # (a share in proportion to each path's rate): about a sixth at the pacers' 40 and 8 MB/s.
        # Under a full test run the disk beneath the pacers can deliver less than 40 MB/s, so the
        # test holds the engine to the policy's own rates, as they were measured.
        rates = pol.state()["rates"]
        balanced = rates[names[1]] / (rates[names[0]] + rates[names[1]])
        after = statistics.median(shares[-4:])
        assert balanced < 0.4 and max(shares[:8]) > 0.35 and after < max(shares[:8]) - 0.1, (shares, rates, decided)
        assert abs(after - balanced) < 0.12, (after, balanced, shares, rates, decided)  # subgroups are a tenth each
        assert_params_close(model, ref)
    finally:
        opt.engine.close()


def depth(double: float, at: int = 4) -> dict:
    """Both paths' probe at start: twice the requests in flight served ``double`` times as fast."""
    return {p: {"at": at, "double": double, "half": 0.8} for p in (A, B)}


def test_a_quiet_run_whose_probe_showed_no_gain_from_depth_changes_no_knob():
    """(d): equal quiet paths whose probe at start served no faster with twice the requests in
    flight. No concurrency trial is spent (the old search tried 4 -> 8 and 4 -> 2 on each path,
    four trials, each reverted), no knob changes at all, and the hold says why."""
    sim = TwoPaths(policy(path_depth_response=depth(1.02)), lambda i: {A: FAST, B: FAST}, noise=0.05, seed=3).run(80)
    assert sim.decisions == []
    assert "no move worth a trial" in sim.policy.state()["holding_reason"]  # what the summary and live view say
    assert any("no move worth a trial" in e["reason"] for e in sim.policy.log if e["kind"] == "hold"), sim.policy.log


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("swinging", [(A, B), (A,)])
def test_a_rate_that_swings_without_the_step_feeling_it_forgets_nothing(seed, swinging):
    """(d) as the emulated tiers ran it: a quiet path's busy-time rates rise 1.8x for a stretch of
    iterations (reads served in a faster regime), both paths' or one's, while the step takes as
    long as before. It is a change of the paths' rates, said, but not of anything the step waits
    on: the start's probes stand, no trial is spent, no knob changes (the old policy forgot the
    probes and tried concurrency 4 -> 8 and 4 -> 2, or re-striped toward the fast path)."""
    swing = lambda i: dict.fromkeys(swinging, 1.8) if 20 <= i < 30 else {}  # noqa: E731
    sim = TwoPaths(policy(path_depth_response=depth(1.02)), lambda i: {A: FAST, B: FAST}, seed=seed, seen=swing).run(60)
    said = [e["reason"] for e in sim.policy.log if "sped up" in e["reason"]]
    assert said and all("the step did not feel it" in r for r in said), sim.policy.log
    assert sim.decisions == [], sim.decisions
    assert set(sim.policy._adapt.depth_response) == {A, B}
    assert any("the step did not feel it" in (a["effect"] or "") for a in sim.policy.state()["adaptations"])


def test_a_path_whose_probe_gained_from_depth_is_tried_deeper():
    """The same run on paths whose probe served 30% faster with twice the requests in flight: each
    path's rise is tried (and the fall, which cannot gain there, is not)."""
    sim = TwoPaths(policy(path_depth_response=depth(1.3)), lambda i: {A: FAST, B: FAST}, conc_speedup=1.3).run(40)
    tried = [e["reason"] for e in sim.policy.log if "trying io_concurrency" in e["reason"]]
    assert any(f"trying io_concurrency[{A}] 4->8" in r for r in tried), sim.policy.log
    assert any(f"trying io_concurrency[{B}] 4->8" in r for r in tried), sim.policy.log
    assert not any("4->2" in r for r in tried), tried


def test_a_path_that_changed_is_tried_again_whatever_its_probe_said():
    """The probe answered for the conditions at start: once a path's rate changes, its concurrency
    is a move again (another tenant's queue may now share it), while the other path's probe holds."""
    sim = TwoPaths(policy(path_depth_response=depth(1.0)), slows(30)).run(45)
    assert [d for d in sim.decisions if d[0] >= 30], "the change was not acted on"
    assert not [d for d in sim.decisions if d[0] < 30 and "io_concurrency" in d[2]], sim.decisions
    assert set(sim.policy._adapt.depth_response) == {A}


def test_the_engine_probes_how_each_path_answers_depth_and_restores_its_limits(tmp_path):
    """Real O_DIRECT files: an unpaced path's probe at start measures its round trip at twice and
    half the run's concurrency (positive ratios, ``at`` the run's), gives the path its limits
    back, and reaches the tuner's registration through ``EngineFacts``; a capped path, paced
    whatever is in flight, is not probed for depth."""
    import torch

    from engine import OffloadAdamW, StoragePath
    from tuner.client import TunerClient
    from tuner.protocol import CLIENT_SCHEMAS, ProtocolError, validate

    free, capped = tmp_path / "free", tmp_path / "capped"
    free.mkdir()
    capped.mkdir()
    model = torch.nn.Linear(200, 200)
    opt = OffloadAdamW(
        model.parameters(),
        subgroup_numel=20_000,
        host_cache_bytes=0,
        io_backend="posix",
        nvme_paths=[StoragePath(path=str(free)), StoragePath(path=str(capped), cap_bytes_per_s=200e6)],
        io_concurrency={str(free): 4},
    )
    try:
        facts = opt.engine.describe()
        ((path, r),) = facts.path_depth_response.items()
        assert os.path.samefile(path, free) and r["at"] == 4 and r["double"] > 0 and r["half"] > 0, r
        sp = opt.engine.swap_paths.paths[0]
        assert sp.read_slots._limit == 4 and sp.write_slots._limit == 4
        client = TunerClient.for_engine(str(tmp_path / "no.sock"), opt.engine, run_id="r", hook=False, connect_timeout_s=0.1)
        client.close()
        msg = client.register_message()
        validate(msg, CLIENT_SCHEMAS)  # what the daemon checks first
        assert RunFacts.from_register(msg).path_depth_response == {os.path.abspath(path): r}
        with pytest.raises(ProtocolError):
            validate({**msg, "path_depth_response": {path: {"at": 4, "double": float("inf")}}}, CLIENT_SCHEMAS)
    finally:
        opt.engine.close()
