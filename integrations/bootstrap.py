"""What each rank runs in place of the user's script: install the engine, then run the script.

The DeepSpeed launcher starts ``python -u bootstrap.py --local_rank=N --offloadctl-config JSON
SCRIPT ARGS...`` (JSON: the rank's ``integrations.settings.RankSettings``). This module installs
the engine into DeepSpeed and starts the recorder (``integrations.ds_patches`` makes every change
to DeepSpeed), then runs SCRIPT with ``sys.argv = [SCRIPT, --local_rank=N, ARGS...]``, exactly
as the launcher would have. It checks that ``deepspeed.initialize`` engaged the engine (ZeRO
stage 3 with optimizer offload), and says so if the script never called it.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys

CONFIG_FLAG = "--offloadctl-config"


def split_argv(argv: list[str]):
    """(the rank's :class:`integrations.settings.RankSettings`, script, script argv without the
    script) from the launcher's arguments."""
    from integrations.settings import RankSettings

    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == CONFIG_FLAG:
            settings = RankSettings.from_json(json.loads(argv[i + 1]))
            i += 2
            script = argv[i]
            return settings, script, rest + argv[i + 1 :]
        rest.append(argv[i])
        i += 1
    raise SystemExit(f"offloadctl bootstrap: missing {CONFIG_FLAG}; start runs with `offloadctl train`")


def _rank() -> int:
    from perf.plan import launcher_rank

    return launcher_rank() or 0


FAILED = "offloadctl: rank {rank} failed: "
"""How a rank of several begins the one line of an error it did not expect (the launcher's
output filter, ``integrations.run_output``, keeps it for the run's last line)."""


PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing", "remote process exited")
"""How gloo's and NCCL's errors say that another rank went away in a collective: this rank's
failure is then the other's consequence."""
PEER_LOST_GRACE_S = 5.0
"""How long a rank that lost a peer waits before it ends: the launcher reports the rank it finds
ended first, and the peer that ended (a one-line refusal, status 2, tearing down after its line)
should be that one, not this rank's connection error."""


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective's report that another rank went away."""
    text = str(error).lower()
    return any(p in text for p in PEER_LOST)


def _failed(settings, error: BaseException) -> None:
    """An error the script raised in a rank of several (its own, or a peer's loss seen in a
    collective): the traceback to the run's log, one line to the terminal (which the launcher's
    filter keeps for the run's last line, once it knows which rank failed first)."""
    import traceback

    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if settings.run_dir and not settings.verbose:
        from integrations import run_output

        try:
            with run_output.open_log(settings.run_dir) as log:
                log.write("".join(f"[rank{_rank()}]: {line}\n" for line in text.splitlines()).encode())
        except OSError:
            print(text, file=sys.stderr, end="")
    else:
        print(text, file=sys.stderr, end="")
    from engine.text import printable, say_line

    first = " ".join(printable(str(error)).split())
    first = first if len(first) <= 300 else first[:297] + "..."
    say_line(FAILED.format(rank=_rank()) + f"{type(error).__name__}: {first}")


class Stopped(BaseException):
    """Raised in the main thread by SIGINT, SIGTERM or SIGHUP: the script unwinds, and the
    engine's swap files go at exit, as after the end of the script. Ctrl-C reaches every rank
    as SIGINT (the terminal signals the whole process group), and ``offloadctl train`` forwards
    a signal sent to it alone as that same signal, so the rank's record and its tuner's run say
    what the user did; DeepSpeed's launcher sends SIGTERM too, after, when one rank fails or it
    is interrupted: the first signal counts."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _later_signal(signum, frame) -> None:
    """A stop signal after the first: the rank is unwinding already. A Python handler, not
    SIG_IGN: a signal that arrived with the first (Ctrl-C's SIGINT, then the launcher's
    SIGTERM) is still pending when the first's handler runs, and Python reports a pending signal
    whose handler became SIG_IGN meanwhile as an error ("ignored due to race condition")."""


def _ignore_later_signals() -> None:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _later_signal)


_FIRST_SIGNAL: dict[str, int] = {}
"""The signal that stopped this rank: the one owner of it (the record's end line and the tuner's
bye both take it from the :class:`Stopped` it raised)."""


def _stop_on_signals() -> None:
    def handler(signum, frame):
        # The first signal unwinds the script; later ones (the launcher repeats them, Ctrl-C
        # twice) must not interrupt the cleanup it started. A signal that arrives while this
        # handler runs (DeepSpeed's launcher's SIGTERM, milliseconds after Ctrl-C's SIGINT,
        # with other threads holding the GIL) runs this handler again inside it, before
        # _ignore_later_signals: whichever raises, it names the first (setdefault: one call,
        # no point between the test and the set where a signal could run Python).
        first = _FIRST_SIGNAL.setdefault("signum", signum)
        _ignore_later_signals()
        raise Stopped(first)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT: inherited ignored, set here
        signal.signal(s, handler)


def _banner(opt, cores: str, run_dir: str | None) -> str:
    """The run's start line, wrapped to the terminal: where the state lives and how it will move."""
    import shutil
    import textwrap

    plan = opt.offload_engine.describe().to_dict()
    tiers = ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in plan["state_bytes_by_tier"].items())
    start = opt.plan_summary or "no profile (paths probed, default knobs)"
    socket = opt.tuner_client.socket_path if opt.tuner_client else None
    own = socket and run_dir and os.path.abspath(socket).startswith(os.path.abspath(run_dir) + os.sep)
    tuner = "tuner off" if not socket else "tuner: this run's own" if own else f"tuner {socket}"
    parts = [
        f"offloadctl: engine active, {plan['subgroups']} subgroups per rank",
        f"state: {tiers}; I/O {plan['io_backend'] or 'none'}; host kernel {plan['host_kernel']}, {cores}",
        f"{start}; {tuner}",
    ]
    history = _history_start(opt.tuner_client)
    if history:
        parts.append(history)
    from engine.text import printable

    parts = [printable(p) for p in parts]  # paths and a profile's name are the user's text
    width = max(40, min(shutil.get_terminal_size().columns, 120))
    return "\n".join(
        textwrap.fill(
            p,
            width,
            initial_indent="" if i == 0 else "  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        for i, p in enumerate(parts)
    )


def _history_start(client, timeout_s: float = 2.0) -> str | None:
    """Which knobs the tuner's history sets for this run's start, and from which earlier run
    (the daemon says so at registration, which takes milliseconds on this node), or None."""
    if client is None or not client.wait_registered(timeout_s) or not client.start_from:
        return None
    import json

    knobs = ", ".join(f"{k}={json.dumps(v)}" for k, v in client.start_from["knobs"].items())
    return (
        f"history: {knobs}, from the tuner's verdict in run {client.start_from['run_id']} (at the first knob "
        f"change; a knob you give is never taken from history)"
    )


def main() -> int:
    settings, script, script_args = split_argv(sys.argv[1:])
    return run_rank(settings, script, script_args)


def run_rank(settings, program: str, args: list[str], *, module: bool = False) -> int:
    """Install the engine from ``settings`` and run ``program`` (a script's path, or with
    ``module`` a module's name, as ``python -m``) with ``args``, as the launcher would have run
    it; the rank's exit status. A stop signal unwinds it wherever it arrives, even inside the
    report of an error (DeepSpeed's launcher stops the other ranks with SIGTERM as soon as one
    fails): the rank then says it stopped, in one line, and removes its swap files at exit."""
    from integrations import ds_patches, run_output

    if not settings.verbose and settings.run_dir:  # before DeepSpeed is imported: it logs as it loads
        log = run_output.open_log(settings.run_dir)
        ds_patches.quiet_deepspeed_logger(log)
        ds_patches.route_deepspeed_warnings(log)
    _stop_on_signals()
    try:
        return _run_program(settings, program, args, module)
    except (Stopped, KeyboardInterrupt) as e:
        _ignore_later_signals()  # the swap files are removed at exit: let nothing cut that short
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        from engine.text import say_line
        from report import recorder
        from tuner.client import note_stopped

        rec = recorder.current()
        # The tuner's bye, sent at exit, says the run was interrupted, at the record's iteration.
        note_stopped(signal.Signals(signum).name, rec.iterations if rec is not None else 0)
        if rec is not None:  # the record's end line, written at exit, says the same
            rec.stopped_by = signal.Signals(signum).name
        say_line(f"offloadctl: rank {_rank()} stopped by {signal.Signals(signum).name}; removing its swap files")
        return 128 + signum


def _run_program(settings, program: str, args: list[str], module: bool) -> int:
    from engine import heap
    from engine.errors import OffloadError
    from engine.storage.native_ops import import_deepspeed
    from engine.text import printable, say_line
    from integrations import ds_patches
    from integrations.cores import bind_rank_cores
    from integrations.cores import describe as describe_cores
    from integrations.deepspeed_zero3 import install
    from perf.plan import launcher_world_size
    from report import recorder

    state = {"engaged": 0}
    try:
        cores = bind_rank_cores(settings.bind_cores)  # before torch starts its threads
        kept = not settings.stock and settings.host_heap == "keep" and heap.keep_freed()  # before torch allocates
        # --engine stock: DeepSpeed's own optimizer, recorded only.
        cls = None if settings.stock else install(settings.zero)

        def check(engine) -> None:
            """The engine engaged in what deepspeed.initialize built (one line where not)."""
            ds_patches.guard_save_checkpoint(engine)  # a full disk under save_checkpoint: one line, stock or ours
            if cls is None:  # --engine stock
                state["engaged"] += 1
                return
            stage = engine.zero_optimization_stage()
            if stage != 3:
                raise OffloadError(
                    f"offloadctl's engine needs ZeRO stage 3, but this ds_config uses stage {stage}: "
                    f"set zero_optimization.stage to 3, or use engine.OffloadAdamW in a plain PyTorch loop"
                )
            if not isinstance(engine.optimizer, cls):
                raise OffloadError(
                    "the offloadctl engine did not engage (DeepSpeed built "
                    f"{type(engine.optimizer).__name__}): check that zero_optimization has offload_optimizer"
                )
            if kept:
                heap.release_freed()  # what building the model and its partitions left free
                engine.optimizer.offload_engine.add_step_hook(heap.KeptHeapWatch())
            state["engaged"] += 1
            if _rank() == 0:
                say_line(_banner(engine.optimizer, describe_cores(cores), settings.run_dir))

        import_deepspeed()  # first, so that the recorder's atexit (registered next) runs before DeepSpeed's

        rec = recorder.start(settings.recorder, script=program, rank=_rank()) if settings.recorder else None
        ds_patches.wrap_initialize(check, rec, rank=_rank())
        if module:
            _run_module(program, args)
        else:
            _run_script(program, args)
    except OffloadError as e:
        if _rank() == 0 or not getattr(e, "every_rank", False):  # the same line from every rank: once
            say_line(f"offloadctl: {printable(str(e))}")
        return 2
    except Exception as e:  # noqa: BLE001 - the script's own error: its traceback to the log, one line shown
        if launcher_world_size() == 1:
            raise
        if peer_lost(e):
            import time

            time.sleep(PEER_LOST_GRACE_S)  # the launcher stops this rank meanwhile, having found the peer ended
        rec = recorder.current()
        if rec is not None:
            rec.error = f"{type(e).__name__}: {e}"
        _failed(settings, e)
        return 1
    if not state["engaged"]:
        say_line(
            f"offloadctl: {program} finished without calling deepspeed.initialize, so the engine never ran: "
            f"call deepspeed.initialize (directly, or through Hugging Face Trainer or Accelerate)"
        )
        return 2
    return 0


def _run_script(script: str, args: list[str]) -> None:
    from engine.errors import OffloadError

    if not os.path.isfile(script):
        raise OffloadError(f"training script {script} does not exist: check the path")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # the script's own exit: keep its status unless it succeeded
        if e.code not in (None, 0):
            raise


def _run_module(name: str, args: list[str]) -> None:
    """``python -m name args``: the module found from the working directory, as there."""
    from engine.errors import OffloadError

    sys.path.insert(0, os.getcwd())
    try:
        import importlib.util

        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise OffloadError(f"module {name} not found from {os.getcwd()}: check the name (--module runs python -m)")
    sys.argv = [name, *args]  # run_module sets argv[0] to the module's file
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise


def _exiting() -> None:
    """The rank is on its way out (the script ended, or failed): a SIGTERM from the launcher
    (stopping the ranks after another failed) must not raise into the interpreter's shutdown,
    which runs the engine's cleanup."""
    _ignore_later_signals()


def finish(run) -> int:
    """``run()``'s status, with the rank's way out guarded: a stop signal that arrives after the
    run returned (the launcher stopping the ranks after another failed) is the status of that
    stop, not a traceback."""
    try:
        try:
            return run()
        finally:
            _exiting()
    except Stopped as e:
        return 128 + e.signum


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(finish(main))
