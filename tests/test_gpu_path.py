"""The GPU path's ordering, memory and bookkeeping, checked on the CPU.

The engine runs its CUDA code path with ``device='cpu'`` and a recording fake of its streams
(``tests/fake_streams.py``): the model's weights are marked as device memory, so the host lane
uploads them through staging buffers on its upload stream, the device lane copies state in and
out chunk by chunk on its h2d/compute/d2h streams, and the device tier updates on its own stream.
Every copy is real (the numerics are checked against torch's AdamW) and every wait is recorded,
so the tests can say what happens before what. What a fake cannot show (the real asynchrony of
copies, pinned memory, events that sleep) is checked by the GPU session (bench/gpu_session.sh).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from fake_streams import RecordingStreams
from helpers import needs_cuda

import engine.buffers
import engine.core
import engine.device_tier
import engine.host_lane
from engine.adamw import AdamWHyper
from engine.binding import FlatSubgroup
from engine.buffers import StateBuffer
from engine.config import EngineConfig, Knobs, StoragePath
from engine.core import SubgroupEngine
from engine.layout import host_buffer_bytes, payload_bytes
from engine.placement import DEVICE_LANE_SLOTS, device_lane_working_bytes
from engine.subgroup import OnDevice

HP = AdamWHyper(lr=1e-2, weight_decay=0.01)
CHUNK = 256  # elements per device-lane chunk in these tests: subgroups go through the lane in several
NUMELS = [1000, 700, 1300, 900, 1100, 600]
STATE = [payload_bytes(n) for n in NUMELS]  # bytes of each subgroup's state, as placement counts them


class _Run:
    """A SubgroupEngine over flat bf16 'device' weights with host bf16 gradients, and torch's
    AdamW on fp32 copies of the same weights, fed the same (unscaled) gradients."""

    def __init__(
        self,
        monkeypatch,
        swap_dir,
        *,
        host_cache_bytes,
        device_cache_bytes=0,
        fraction=0.5,
        scale=0.5,
        numels=NUMELS,
        device_grads=(),
        fake=None,
        auto_fraction=False,
    ):
        self.fake = fake or RecordingStreams()
        monkeypatch.setattr(engine.core, "streams_for", lambda device: self.fake)
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in numels]
        self._mark(*self.weights)
        self.bindings = [FlatSubgroup(w) for w in self.weights]
        self.device_grads = set(device_grads)
        for b in self.bindings:
            b.grad_scale = scale
        self.scale = scale
        self.ref = [torch.nn.Parameter(w.float()) for w in self.weights]
        self.ref_opt = torch.optim.AdamW(self.ref, lr=HP.lr, weight_decay=HP.weight_decay)
        cfg = EngineConfig(
            device="cpu",
            host_cache_bytes=host_cache_bytes,
            device_cache_bytes=device_cache_bytes,
            paths=(StoragePath(path=swap_dir),),
            host_adam="torch",
            io_backend="posix",
            auto_device_fraction=auto_fraction,
        )
        self.engine = SubgroupEngine(self.bindings, cfg, Knobs(device_fraction=fraction, prefetch_depth=1))
        self.engine.device_lane.chunk_numel = CHUNK
        self.gen = torch.Generator().manual_seed(1)

    def _mark(self, *tensors):
        if isinstance(self.fake, RecordingStreams):
            self.fake.mark_device(*tensors)

    @property
    def copies(self):
        return self.fake.copies if isinstance(self.fake, RecordingStreams) else []

    def step(self):
        for i, (b, p) in enumerate(zip(self.bindings, self.ref)):
            g = torch.randn(b.numel, generator=self.gen).to(torch.bfloat16)
            if i in self.device_grads:
                g = g.clone()
                self._mark(g)
            b.grad = g
            p.grad = g.float() * self.scale
        first_copy = len(self.copies)
        rec = self.engine.step([HP])
        self.ref_opt.step()
        return rec, self.copies[first_copy:]

    def check_numerics(self):
        for i, p in enumerate(self.ref):
            master, _, _, _ = self.engine.read_state(i)
            torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(self.weights[i], p.detach().to(torch.bfloat16), rtol=0, atol=0)


def _stream_names(run: _Run) -> dict[str, str]:
    lane = run.engine.device_lane
    return {
        lane.h2d.name: "h2d",
        lane.compute.name: "compute",
        lane.d2h.name: "d2h",
        lane.resident.name: "resident",
        run.engine.host_lane.weights.stream.name: "upload",
    }


def test_every_weight_write_is_joined_to_the_current_stream_before_step_returns(monkeypatch, swap_dir):
    """DeepSpeed's all-gather inside step(), checkpoints and the next forward read the weights on
    the caller's stream: the host lane's uploads (and the lanes' casts) are ordered before anything
    queued there after step() returns."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:3]), device_cache_bytes=STATE[0])
    names = _stream_names(run)
    for _ in range(4):
        rec, copies = run.step()
        writes = [c for c in copies if c.to_device]
        kinds = {names[c.stream] for c in writes}
        assert {"upload", "compute", "resident"} <= kinds, kinds  # all three writers ran
        late = [c for c in writes if not c.before(run.fake.default.clock)]
        assert not late, f"{len(late)} weight writes on {sorted({names[c.stream] for c in late})} not joined"
        assert rec.device_tier_subgroups == 1
    assert not run.fake.races()
    run.check_numerics()
    run.engine.close()


def test_device_lane_copies_chunks_through_slots_in_order(monkeypatch, swap_dir):
    """Slots are reused every DEVICE_LANE_SLOTS chunks: a chunk's copy in must wait for the copy
    out of the chunk that last used its slot, and a buffer's next copy in for its last copy back."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:2]), fraction=1.0, device_grads={1, 4})
    for _ in range(4):
        rec, copies = run.step()
        assert rec.device_lane_subgroups == len(NUMELS) and rec.host_lane_subgroups == 0
    assert not run.fake.races()
    run.check_numerics()
    run.engine.close()


def test_device_tier_updates_never_wait_for_the_lane(monkeypatch, swap_dir):
    """In reverse-order steps too, the device tier's updates run on their own stream, issued
    before any lane work of the step: never queued behind the lane's last copy in."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:3]), device_cache_bytes=sum(STATE[:2]), fraction=1.0)
    names = _stream_names(run)
    for _ in range(4):  # two forward-order, two reverse-order steps
        lane_before = {s.name: s.clock.get(s.name, 0) for s in run.fake.streams}
        rec, copies = run.step()
        resident = [k for k, c in enumerate(copies) if names.get(c.stream) == "resident"]
        lane = [k for k, c in enumerate(copies) if names.get(c.stream) in ("h2d", "compute", "d2h")]
        assert resident and lane and max(resident) < min(lane)  # queued first
        for k in resident:
            for s in ("h2d", "compute", "d2h"):
                name = next(n for n, v in names.items() if v == s)
                assert copies[k].clock.get(name, 0) <= lane_before[name]  # never after this step's lane work
        assert rec.device_tier_subgroups == 2
        assert rec.device_lane_subgroups == len(NUMELS) - 2  # the tier is not counted on the lane
    run.check_numerics()
    run.engine.close()


def _lane_bytes(lane) -> int:
    """The device memory a lane uses at most, as the engine counts it."""
    return device_lane_working_bytes(lane.capacity_numel, lane.n_slots, lane.chunk_numel)


def test_lane_memory_does_not_grow_with_the_subgroup(monkeypatch, swap_dir):
    """The lane's device memory is its chunk slots, whatever the subgroup size."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=0, fraction=1.0, numels=[8000, 20000])
    run.step()
    lane = run.engine.device_lane
    slot_bytes = sum(t.numel() * t.element_size() for s in lane._slots for t in (s.state, s.grad, s.weights))
    assert len(lane._slots) == DEVICE_LANE_SLOTS
    assert slot_bytes == DEVICE_LANE_SLOTS * 20 * CHUNK
    assert _lane_bytes(lane) == device_lane_working_bytes(20000, chunk_numel=CHUNK) == (20 * 3 + 8) * CHUNK
    assert device_lane_working_bytes(10**9) == device_lane_working_bytes(10**8)  # DeepSpeed's default and ours
    run.check_numerics()
    run.engine.close()


def _fast_lane_rates(monkeypatch):
    """Rates under which the balance would put everything on the device lane."""
    monkeypatch.setattr(engine.device_tier, "measure_lane_rates", lambda device: (50e9, 50e9, 80e9, 200e9))
    monkeypatch.setattr(engine.device_tier, "host_lane_rate", lambda name: 1e6)
    monkeypatch.setattr(engine.device_tier, "node_memory_bandwidth", lambda: None)  # the machine's file is not the test's


def test_lane_is_off_when_its_slots_do_not_fit(monkeypatch, swap_dir, caplog):
    """When the state does not fit the GPU, the lane runs only if its slots fit what is left
    (rates alone would turn it on and the first slot allocation would run out of memory); it says
    why it does not in one line, and no knob turns it on."""
    _fast_lane_rates(monkeypatch)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:3]), device_cache_bytes=None, fraction=0.0, auto_fraction=True)
    too_small = _lane_bytes(run.engine.device_lane) - 1
    with caplog.at_level(logging.WARNING):
        fit = run.engine.fit_device_tier(headroom_bytes=too_small)
    assert fit.device_tier_subgroups == 0 and fit.device_fraction == 0.0 and fit.device_lane_off
    assert any("device lane off" in r.getMessage() for r in caplog.records)
    run.engine.set_knobs(run.engine.knobs.replace(device_fraction=0.5))  # as --device-fraction or a tuner push
    for _ in range(2):
        rec, _ = run.step()
        assert rec.device_lane_subgroups == 0 and rec.knobs.device_fraction == 0.0
    assert run.engine.device_lane._slots == []  # never allocated
    run.check_numerics()
    run.engine.close()


def test_lane_balance_runs_when_the_slots_fit(monkeypatch, swap_dir):
    _fast_lane_rates(monkeypatch)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:3]), device_cache_bytes=None, fraction=0.0, auto_fraction=True)
    fit = run.engine.fit_device_tier(headroom_bytes=_lane_bytes(run.engine.device_lane) + STATE[0] + 1)
    assert fit.device_tier_subgroups == 1 and fit.device_lane_off is None and fit.device_fraction == 1.0
    rec, _ = run.step()
    assert rec.device_lane_subgroups == len(NUMELS) - 1
    run.check_numerics()
    run.engine.close()


def test_a_refused_pin_is_not_tried_again(monkeypatch):
    """pin() is called at every device-lane update; a refusal costs no driver call the next times."""
    calls = []
    monkeypatch.setattr(engine.buffers, "pin_in_place", lambda t: calls.append(1) or False)
    buf = StateBuffer(1000)
    assert not buf.pin() and not buf.pin() and not buf.pin()
    assert len(calls) == 1


def test_nothing_is_pinned_before_the_device_fit(monkeypatch, swap_dir):
    """Nothing is pinned at construction: the fit may move the starting fraction's buffers to
    the device tier, and pinning them first would be seconds of start-up and an RSS spike for nothing."""
    pinned = []
    monkeypatch.setattr(StateBuffer, "pin", lambda self: pinned.append(self) or True)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, device_cache_bytes=None, fraction=0.5)
    assert pinned == []
    run.step()  # the fit (headroom: half the host's free memory) puts every subgroup in the device tier
    assert pinned == [] and run.engine.describe().state_bytes_by_tier == {"device": sum(STATE)}
    run.check_numerics()
    run.engine.close()


def test_one_time_costs_of_a_lane_change_are_not_in_the_measured_step(monkeypatch, swap_dir):
    """A tuner trial that moves subgroups to the device lane pins their buffers (seconds for
    GBs); that is the step's setup, not its update time or the next iteration's."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, device_cache_bytes=0, fraction=0.0)
    run.step()
    slow = 2.0  # seconds: far above a step of these few kB, even on a loaded machine (1.0 failed at load 7)
    pinned = set()

    def pin(self):  # as the real one: the first call per buffer costs, the next ones return at once
        if id(self) not in pinned:
            pinned.add(id(self))
            time.sleep(slow / len(NUMELS))
        return True

    monkeypatch.setattr(StateBuffer, "pin", pin)
    run.engine.set_knobs(run.engine.knobs.replace(device_fraction=1.0))
    rec, _ = run.step()
    assert rec.device_lane_subgroups == len(NUMELS)
    # Counted in it, the pins would make the update at least `slow` on top of its own time; so
    # `slow` itself is the bound that tells the two apart with the most room for a loaded machine
    # (a bound of half of it failed once with three test runs side by side on 2 cores).
    assert rec.setup_s >= slow * 0.9 and rec.update_s < slow
    with run.engine.setup_time():  # what an adapter does between steps (device gradient buffers)
        time.sleep(slow)
    rec, _ = run.step()
    assert rec.setup_s >= slow * 0.9 and rec.fwd_bwd_s < slow
    run.check_numerics()
    run.engine.close()


def test_cuda_events_are_blocking(monkeypatch):
    """A host wait on a default event spins a core beside the host lane's AdamW threads: every
    event the engine waits on comes from CudaStreams.record, and it asks for a blocking one."""
    from engine.streams import CudaStreams

    made = []

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            made.append(blocking)

        def record(self, stream=None):
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    CudaStreams(torch.device("cuda", 0)).record(object())
    assert made == [True]


def test_only_the_seam_makes_cuda_streams_and_events():
    """Every stream and event of the step comes through engine.streams (blocking events, one
    place to fake); gpumem's timing events are measurements, waited on once at start."""
    import ast
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine")
    bad = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py") or f in ("streams.py", "gpumem.py"):
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read())):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("Event", "Stream", "stream", "synchronize")
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "cuda"
                ):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno} torch.cuda.{node.attr}")
    assert not bad, bad


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_host_streams_run_the_same_path(monkeypatch, swap_dir, fraction):
    """Without the fake, device='cpu' runs the same code on HostStreams (everything at once)."""
    from engine.streams import HostStreams

    run = _Run(
        monkeypatch,
        swap_dir,
        host_cache_bytes=sum(STATE[:3]),
        device_cache_bytes=STATE[0],
        fraction=fraction,
        fake=HostStreams(torch.device("cpu")),
    )
    for _ in range(3):
        rec, _ = run.step()
    assert rec.device_tier_subgroups == 1
    assert rec.device_lane_subgroups == round((len(NUMELS) - 1) * fraction)
    run.check_numerics()
    run.engine.close()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads")
@pytest.mark.parametrize(
    "host_cache,io_cores,expect_less",
    [(0, 1, True), (0, 0, False), (None, 1, False)],
    ids=["swapped", "io-cores-0", "all-in-memory"],
)
def test_host_lane_leaves_a_core_to_the_io_threads(monkeypatch, swap_dir, host_cache, io_cores, expect_less):
    """With state on storage, the I/O threads checksum every chunk while the host lane's OpenMP
    threads run; sharing a core slows the whole kernel to its slowest thread (bench/io_cores.py),
    so the lane leaves them one."""
    from engine.adamw import adamw_update_torch_

    seen = []

    def kernel(s, hp):
        seen.append(torch.get_num_threads())
        adamw_update_torch_(s, hp)

    monkeypatch.setattr(engine.core, "select_host_kernel", lambda choice, **_: ("torch", kernel))
    threads = torch.get_num_threads()
    cfg = EngineConfig(
        host_cache_bytes=host_cache, paths=(StoragePath(path=swap_dir),), host_adam="torch", io_backend="posix", io_cores=io_cores
    )
    w = torch.randn(5000)
    eng = SubgroupEngine([FlatSubgroup(w[:2500], torch.randn(2500)), FlatSubgroup(w[2500:], torch.randn(2500))], cfg)
    eng.step([HP])
    eng.step([HP])
    assert seen and set(seen) == {threads - 1 if expect_less else threads}
    assert torch.get_num_threads() == threads  # restored after the step
    eng.close()


# -- on a GPU (bench/gpu_session.sh check runs these) ----------------------------------------------


def _cuda_engine(swap_dir, numels, **cfg):
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, generator=gen).to(device=dev, dtype=torch.bfloat16) for n in numels]
    bindings = [FlatSubgroup(w, torch.randn(n, generator=gen).to(torch.bfloat16).pin_memory()) for w, n in zip(weights, numels)]
    for b in bindings:
        b.grad_scale = 0.5
    conf = dict(device=str(dev), host_adam="torch", io_backend="posix", paths=(StoragePath(path=swap_dir),))
    conf.update(cfg)
    return SubgroupEngine(bindings, EngineConfig(**conf), Knobs(device_fraction=0.5, prefetch_depth=1)), weights


@needs_cuda
def test_cuda_weights_are_ready_on_the_current_stream(swap_dir):
    """On a GPU: work queued on the current stream right after step() returns (DeepSpeed's
    all-gather, the next forward) reads every subgroup's new weights, whichever lane wrote them.
    Subgroups of 2^24 elements make the uploads long enough to be caught in flight."""
    numels = [1 << 24] * 4
    eng, weights = _cuda_engine(swap_dir, numels, host_cache_bytes=None, device_cache_bytes=payload_bytes(1 << 24))
    for _ in range(3):
        eng.step([HP])
        snap = [w.clone() for w in weights]  # queued on the current stream, no sync before it
        torch.cuda.synchronize()
        for i, s in enumerate(snap):
            master = eng.read_state(i)[0]
            assert torch.equal(s.cpu(), master.to(torch.bfloat16)), f"subgroup {i} read stale weights"
    eng.close()


@needs_cuda
def test_cuda_event_waits_sleep():
    """A host wait on the engine's events sleeps (cudaEventBlockingSync) instead of spinning."""
    from engine.streams import CudaStreams

    dev = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(dev)
    s = streams.new_stream()
    with streams.use(s):
        torch.cuda._sleep(int(1.5e9))  # about a second of GPU time
        ev = streams.record(s)
    t_wall, t_cpu = time.perf_counter(), time.thread_time()
    ev.synchronize()
    wall, cpu = time.perf_counter() - t_wall, time.thread_time() - t_cpu
    assert wall > 0.2 and cpu < 0.2 * wall, (wall, cpu)


@needs_cuda
def test_cuda_lane_memory_is_its_slots(swap_dir):
    """On a GPU: subgroups of 2^26 elements (800 MB of state each) go through the device lane in
    ~570 MB of slots, not 3 x 12 B x 2^26 = 2.4 GB."""
    numels = [1 << 26] * 2
    eng, _ = _cuda_engine(swap_dir, numels, host_cache_bytes=None, device_cache_bytes=0)
    eng.set_knobs(eng.knobs.replace(device_fraction=1.0))
    eng.step([HP])  # the fit, the slots
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng.step([HP])
    torch.cuda.synchronize()
    assert eng.telemetry.records[-1].device_lane_subgroups == 2
    assert torch.cuda.max_memory_allocated() - base <= _lane_bytes(eng.device_lane) // 4  # slots already there
    assert _lane_bytes(eng.device_lane) <= 600e6
    eng.close()


def test_release_device_gives_everything_back_until_the_next_step(monkeypatch, swap_dir):
    """What DeepSpeed's offload_states asks (RLHF: the GPU free for generation): the device tier's
    state to host memory, the lane's slots freed; the next step fits both again, numbers exact."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[:3]), device_cache_bytes=sum(STATE[:2]), fraction=1.0)
    run.step()
    assert run.engine.device_lane._slots
    run.engine.release_device()
    assert run.engine.describe().state_bytes_by_tier.get("device", 0) == 0
    assert run.engine.device_lane._slots == []
    rec, _ = run.step()
    assert rec.device_tier_subgroups == 2 and rec.device_lane_subgroups == len(NUMELS) - 2
    run.check_numerics()
    run.engine.close()


def test_release_device_brings_back_the_placed_subgroups_not_a_prefix(monkeypatch, swap_dir):
    """A device budget is filled in order, skipping subgroups that do not fit: here the first and
    the last. After release_device the next step's fit puts back those two, not the first two."""
    budget = STATE[0] + STATE[5]  # the 2nd to 5th are each larger than what is left after the 1st
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE), device_cache_bytes=budget, fraction=0.0)
    for _ in range(2):
        rec, _ = run.step()
        assert [sg.index for sg in run.engine.subgroups if sg.tier.kind == "device"] == [0, 5]
        run.engine.release_device()
    rec, _ = run.step()
    assert rec.device_tier_subgroups == 2 and run.engine.describe().state_bytes_by_tier["device"] == budget
    run.check_numerics()
    run.engine.close()


# -- measurements, device placement of gradients, the tier's host buffers, the host lane's transfers --


def test_no_measurement_draws_from_a_generator_the_model_uses():
    """Nothing the engine runs in the training process draws random numbers except from a
    generator of its own (``generator=``), nor seeds or sets a global generator: a draw from the
    device's default generator (the GPU AdamW timing's operands, say) would change every dropout
    mask against a stock run with the same seed."""
    import ast
    import os

    draws = {
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "normal",
        "bernoulli",
        "multinomial",
        "normal_",
        "uniform_",
        "random_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
    }
    seeds = {"manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = []
    for top in ("engine", "integrations"):
        for dirpath, _, files in os.walk(os.path.join(here, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                        continue
                    name, owner = node.func.attr, node.func.value
                    global_seed = name in seeds and not isinstance(owner, ast.Call)  # torch.Generator().manual_seed is its own
                    if (name in draws and not any(k.arg == "generator" for k in node.keywords)) or global_seed:
                        bad.append(f"{os.path.relpath(path, here)}:{node.lineno} {name}")
    assert not bad, bad


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    """'cuda' is the current CUDA device, with its index: tensors on cuda:0 compare equal to the
    lane's device and are read in place (OffloadAdamW(device='cuda') takes the fast path)."""
    from engine.streams import CudaStreams, resolve_lane_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_lane_device("cuda") == torch.device("cuda", 1)
    assert resolve_lane_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_lane_device(None) == torch.device("cuda", 1)
    streams = CudaStreams(torch.device("cuda"))
    assert streams.device == torch.device("cuda", 1)
    on_1 = type("T", (), {"device": torch.device("cuda", 1)})()
    on_0 = type("T", (), {"device": torch.device("cuda", 0)})()
    assert streams.on_device(on_1) and not streams.on_device(on_0)


def test_a_pending_lane_change_moves_the_gradients_placed_for_the_next_step(monkeypatch, swap_dir):
    """device_grad_subgroups() answers for the next step's lanes, a device fraction set and not
    yet applied included (the engine's side of placing gradients for a lane change)."""
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, device_cache_bytes=0, fraction=0.0)
    run.engine.fit_device_tier(grad_bytes_per_element=2, headroom_bytes=10**9)
    run.step()
    assert run.engine.device_grad_subgroups() == []
    run.engine.set_knobs(run.engine.knobs.replace(device_fraction=1.0))
    placed = run.engine.device_grad_subgroups()
    assert placed == list(range(len(NUMELS)))  # the budget holds every lane gradient
    run.device_grads = set(placed)  # as the adapter places them before the next backward
    rec, copies = run.step()
    assert rec.device_lane_subgroups == len(NUMELS) and run.engine.device_tier.device_grads == set(placed)
    grads = [(b.grad.data_ptr(), b.grad.data_ptr() + 2 * b.grad.numel()) for b in run.bindings]
    uploads = [c for c in copies if any(lo < c.src[1] and c.src[0] < hi for lo, hi in grads)]
    assert not uploads  # every gradient was read in place, where it was placed
    run.check_numerics()
    run.engine.close()


def test_release_device_keeps_pinned_host_buffers_across_cycles(monkeypatch, swap_dir):
    """From the first release on, the device tier keeps its host buffers, pinned once, counted in
    the host budget as copies: the next offload_states()/reload_states() cycles allocate and pin
    nothing (fresh pageable buffers cost about 6 s a cycle at 4B)."""
    made, pinned = [], []
    real_init, real_pin = StateBuffer.__init__, StateBuffer.pin

    def init(self, *a, **k):
        made.append(self)
        real_init(self, *a, **k)

    def pin(self):
        if not self._pin_tried:
            pinned.append(self)
        return real_pin(self)

    monkeypatch.setattr(StateBuffer, "__init__", init)
    monkeypatch.setattr(StateBuffer, "pin", pin)
    tier = sum(STATE[:2])
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=sum(STATE[2:]), device_cache_bytes=tier, fraction=0.0)
    run.step()
    copies_before = run.engine.host_usage().copies
    run.engine.release_device()
    first = list(made)
    assert len(pinned) == 2  # the tier's two buffers, pinned where the copy out goes
    run.step()  # refit: the tier back on the device, its buffers kept
    assert run.engine.host_usage().copies - copies_before >= tier
    for _ in range(2):
        made.clear()
        pinned.clear()
        run.engine.release_device()
        assert made == [] and pinned == []
        rec, _ = run.step()
        assert rec.device_tier_subgroups == 2
    run.check_numerics()
    assert first  # the first cycle did allocate (the test is not vacuous)
    run.engine.close()


def test_the_tiers_host_buffers_are_kept_only_within_the_host_budget(monkeypatch, swap_dir):
    """A spare host copy of the device tier is host memory like any other: kept only while the
    rank's host budget has room for it."""
    tier = sum(STATE[:2])
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, device_cache_bytes=tier, fraction=0.0)
    run.step()
    usage = run.engine.host_usage()
    run.engine.host_memory.budget_bytes = usage.total + host_buffer_bytes(NUMELS[0]) + 64  # room for the first buffer only
    run.engine.release_device()
    run.step()
    kept = [sg.index for sg in run.engine.subgroups if isinstance(sg.home, OnDevice) and sg.home.host_copy is not None]
    assert kept == [0]  # the first fits, the second would not have
    run.check_numerics()
    run.engine.close()


@needs_cuda
def test_cuda_lane_rates_leave_the_generators_alone():
    """On a GPU: measuring the lanes at the first step draws nothing from the CPU's or the GPU's
    default generator (a stock run with the same seed keeps its dropout masks)."""
    import engine.gpumem as gm

    for f in (gm.measure_pcie, gm.measure_gpu_adamw, gm.measure_memory_bandwidth):
        f.cache_clear()
    dev = torch.device("cuda", torch.cuda.current_device())
    cuda_rng, cpu_rng = torch.cuda.get_rng_state(dev), torch.get_rng_state()
    assert gm.measure_lane_rates(dev) is not None
    assert torch.equal(torch.cuda.get_rng_state(dev), cuda_rng) and torch.equal(torch.get_rng_state(), cpu_rng)


@needs_cuda
def test_cuda_refit_after_release_measures_the_training_peak(swap_dir):
    """On a GPU: after release_device() and a generation phase that filled the GPU, the device
    tier's returned() makes the next fit measure the training's peak again, not the generation's:
    the headroom is the first fit's."""
    eng, _ = _cuda_engine(swap_dir, [1 << 22] * 8, host_cache_bytes=None, device_cache_bytes=None)
    dev = eng.device

    def peak(nbytes):  # a forward/backward (or a generation): allocated, then freed
        x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        del x

    peak(1 << 30)
    first = eng.fit_device_tier(grad_bytes_per_element=2)
    eng.step([HP])
    eng.release_device()
    peak(int(torch.cuda.mem_get_info(dev)[0] * 0.8))  # generation
    eng.device_tier.returned()
    peak(1 << 30)
    again = eng.fit_device_tier(grad_bytes_per_element=2)
    assert abs(again.headroom_bytes - first.headroom_bytes) <= max(256 << 20, first.headroom_bytes // 20), (first, again)
    assert again.device_tier_subgroups == first.device_tier_subgroups
    eng.step([HP])
    eng.close()


@needs_cuda
def test_cuda_an_eval_pass_into_the_margin_moves_the_tier_off(swap_dir, caplog):
    """On a GPU (issue 47 item 4): after the fit, a pass between steps that comes three quarters
    into the margin (an evaluation with a bigger batch) makes the next step move the tier's
    subgroups to host memory, said in one line, and the step after it runs. The margin is 6% of
    the memory this process may use (item 5), and the fit says how much that was."""
    import logging

    from engine import gpumem

    eng, _ = _cuda_engine(swap_dir, [1 << 22] * 8, host_cache_bytes=None, device_cache_bytes=None)
    dev = eng.device
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # forward/backward's peak
    del x
    fit = eng.fit_device_tier(grad_bytes_per_element=2)
    usable = gpumem.usable_bytes(dev)
    assert fit.usable_bytes == usable and fit.margin_bytes == gpumem.margin_bytes_of(usable), fit
    eng.step([HP])
    assert fit.device_tier_subgroups > 0, fit
    left = gpumem.gpu_memory_left(dev)
    x = torch.empty(max(0, left) + 3 * fit.margin_bytes // 4, dtype=torch.uint8, device=dev)  # the eval
    del x
    caplog.set_level(logging.WARNING, logger="engine.device_tier")
    rec = eng.step([HP])
    assert rec.device_tier_subgroups < fit.device_tier_subgroups, rec
    assert rec.device_usable_bytes == gpumem.usable_bytes(dev)
    assert sum("device-tier subgroup" in r.getMessage() for r in caplog.records) == 1
    eng.step([HP])
    eng.close()


def _spans(tensors) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def _touches(c, spans, src=True) -> bool:
    lo, hi = c.src if src else c.dst
    return any(a < hi and lo < b for a, b in spans)


def test_host_lane_uploads_weights_a_chunk_at_a_time_through_a_few_pinned_buffers(monkeypatch, swap_dir):
    """Weights on the GPU go up a chunk at a time through UPLOAD_SLOTS pinned chunk buffers per
    host-lane thread, pinned once at the first uploads, whatever the subgroup size (no whole-subgroup
    staging: 2 x 2 GB pinned at sub_group_size 1e9 and a serial last upload of 2 GB); each copy
    is joined to the caller's stream."""
    from engine.host_lane import UPLOAD_SLOTS

    pins = []
    real = engine.host_lane.aligned_empty

    def aligned_empty(nbytes, pin=False):
        if pin:
            pins.append(nbytes)
        return real(nbytes, pin=pin)

    monkeypatch.setattr(engine.host_lane, "aligned_empty", aligned_empty)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, fraction=0.0)
    up = run.engine.host_lane.weights
    up.chunk_numel = CHUNK
    names = _stream_names(run)
    weights = _spans(run.weights)
    for it in range(4):
        rec, copies = run.step()
        assert rec.host_lane_subgroups == len(NUMELS)
        uploads = [c for c in copies if _touches(c, weights, src=False)]
        assert uploads and all(names[c.stream] == "upload" for c in uploads)
        assert all(c.dst[1] - c.dst[0] <= 2 * CHUNK for c in uploads)  # bf16: a chunk at most, the last one too
        assert not [c for c in uploads if not c.before(run.fake.default.clock)]
        if it == 0:
            first = list(pins)
    rings = len(up._rings)  # one per host-lane thread that uploaded
    assert 1 <= rings <= torch.get_num_threads()
    assert pins == first == [4 * CHUNK] * (UPLOAD_SLOTS * rings)  # pinned at the first uploads; nothing after
    assert up.host_bytes() == rings * UPLOAD_SLOTS * 4 * CHUNK
    assert not run.fake.races()
    run.check_numerics()
    run.engine.close()


def test_host_lane_reads_device_gradients_a_chunk_ahead(monkeypatch, swap_dir):
    """OffloadAdamW with the model on a GPU: each host-lane chunk's gradient comes down through
    pinned chunk buffers on a stream of their own, after backward's work, the next chunk's copy
    issued before the host waits for this one's (not a synchronous copy into pageable memory)."""
    from engine.host_lane import GradReader

    monkeypatch.setattr(engine.host_lane, "HOST_CHUNK_NUMEL", CHUNK)
    run = _Run(monkeypatch, swap_dir, host_cache_bytes=None, fraction=0.0, device_grads=set(range(len(NUMELS))))
    run.engine.host_lane.grads = reader = GradReader(run.fake, chunk_numel=CHUNK)
    for _ in range(3):
        first = len(run.copies)
        rec, _ = run.step()
        assert rec.host_lane_subgroups == len(NUMELS)
        grads = _spans([b.grad for b in run.bindings])
        down = [k for k in range(first, len(run.copies)) if _touches(run.copies[k], grads)]
        assert down and all(run.copies[k].stream == reader.stream.name for k in down)
        assert len(down) == sum(-(-n // CHUNK) for n in NUMELS)  # one copy a chunk
        for span in grads:  # within a subgroup, the next chunk's copy is issued before this one is waited for
            mine = [k for k in down if _touches(run.copies[k], [span])]
            assert len(mine) >= 3
            for k, nxt in zip(mine, mine[1:]):
                wait = run.fake.first_wait_for(k)
                assert wait is not None and run.fake.position(nxt) < wait
    assert not run.fake.races()
    run.check_numerics()
    run.engine.close()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two threads")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to tell apart")
def test_a_host_lane_worker_runs_on_one_thread_whatever_the_caller_sets_later():
    """torch sets a thread's count up at its first op, from the process-wide count: a worker that
    only called set_num_threads(1) took the caller's count back at its first op once the caller
    restored it, and ran its parts with a team and barriers again (a race with the caller's part)."""
    lane = engine.host_lane.LaneThreads()
    try:
        lane._grow(1)  # the caller's count is back on return
        assert torch.get_num_threads() >= 2
        seen = []
        lane._queues[0].put((1, lambda k: seen.append(torch.get_num_threads())))
        assert lane._done.get(timeout=30) is None
        assert seen == [1]
    finally:
        lane.close()


def test_host_lane_threads_update_their_own_parts_on_one_thread_each(monkeypatch):
    """Each of the host lane's threads updates its own part of a subgroup with ops that run on it
    alone, and the math is the same, element for element, as one thread driving the lane. (Driven
    by one thread, every op of every chunk is a parallel region of all the process's OpenMP
    threads ending in a barrier, each waiting for whichever thread anything else on the cores
    descheduled.)"""
    from engine.adamw import adamw_update_torch_
    from engine.host_lane import PART_CHUNK_NUMEL

    seen = []

    def kernel(s, hp):
        import threading

        seen.append((threading.get_ident(), torch.get_num_threads()))
        adamw_update_torch_(s, hp)

    monkeypatch.setattr(engine.core, "select_host_kernel", lambda choice, **_: ("torch", kernel))
    threads = torch.get_num_threads()
    n = 3 * PART_CHUNK_NUMEL + 1000
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    b, b1 = FlatSubgroup(w, g), FlatSubgroup(w.clone(), g)
    b.grad_scale = b1.grad_scale = 0.5
    ref = torch.nn.Parameter(w.float())
    ref_opt = torch.optim.AdamW([ref], lr=HP.lr, weight_decay=HP.weight_decay)
    eng = SubgroupEngine([b], EngineConfig(host_cache_bytes=None, host_adam="torch"))
    one = SubgroupEngine([b1], EngineConfig(host_cache_bytes=None, host_adam="torch"))
    one.host_lane._threads = None  # driven by one thread
    eng.host_lane._threads.chunk_costs = (0.0, 1.0)  # no lock bound: PART_CHUNK_NUMEL chunks (issue 47)
    for _ in range(2):
        ref.grad = g.float() * 0.5
        eng.step([HP])
        ref_opt.step()
    parts = list(seen)
    for _ in range(2):
        one.step([HP])
    assert {k for _, k in parts} == {1}  # every op on its thread alone
    assert len({t for t, _ in parts}) == min(threads, 4)  # the chunks spread over the lane's threads
    assert torch.get_num_threads() == threads  # the caller's count is back
    assert torch.equal(eng.read_state(0)[0], one.read_state(0)[0]) and torch.equal(w, b1.weight)  # the same math
    torch.testing.assert_close(eng.read_state(0)[0], ref.detach(), rtol=1e-6, atol=1e-7)
    eng.close()
    one.close()
