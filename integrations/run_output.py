"""What a run shows on the terminal and what goes to the run dir's log.

The terminal gets the user's script's output, offloadctl's lines and DeepSpeed's errors.
DeepSpeed's own chatter (its logger's INFO/WARNING lines from the launchers and the ranks, the
"op built" prints, Python warnings raised inside DeepSpeed) goes to ``RUN_DIR/deepspeed.log``;
``offloadctl train --verbose`` shows it as well. Nothing is dropped: every line ends up in one
of the two places, and an error is always shown.

Three places do the sorting, because DeepSpeed speaks from three kinds of process:
- ``integrations.ds_patches.quiet_deepspeed_logger`` in every process of ours (the CLI, each
  rank) before DeepSpeed is imported: its logger's records below ERROR go to the log file (or
  nowhere in the CLI).
- ``integrations.ds_patches.route_deepspeed_warnings`` in each rank: a warning whose first frame
  outside torch is in DeepSpeed goes to the log; the user's own warnings are shown as Python
  shows them.
- :class:`OutputFilter` in ``offloadctl train`` on the launcher's stdout and stderr, for the
  processes we do not start ourselves (DeepSpeed's runner and per-node launcher).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading

from engine.record_files import private_opener

LOG_NAME = "deepspeed.log"
"""DeepSpeed's lines of a run, in its run dir."""

# DeepSpeed's log format: "[2026-11-24 13:59:47,667] [WARNING] [runner.py:214:fetch_hostfile] ..."
_DS_LOG_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[(DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ")
_DS_LOG_TEMPLATE = b"[0000-00-00 00:00:00,000] ["
# The same, hidden, starting in the middle of a line: another process's log line written after a
# progress bar that has no newline yet (DeepSpeed writes each record with one write).
_DS_LOG_INSIDE = re.compile(rb"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[(DEBUG|INFO|WARNING)\] ")
# DeepSpeed's prints that are not log records (op builds and loads, printed by every rank).
_DS_PRINTS = re.compile(
    rb"^(DeepSpeed deepspeed\.ops\.\S+ built successfully|Using \S+ as PyTorch extensions root|"
    rb"Emitting ninja build file |Building extension module |Loading extension module |"
    rb"Time to load \S+ op: |ninja: no work to do|Detected CUDA files, patching ldflags|"
    rb"Allowing ninja to set a default number of workers)"
)
_DS_PRINT_STARTS = (
    b"DeepSpeed ",
    b"Using ",
    b"Emitting ",
    b"Building ",
    b"Loading ",
    b"Time to ",
    b"ninja:",
    b"Detected ",
    b"Allowing ",
)
_SHOWN_LEVELS = (b"ERROR", b"CRITICAL")
# DeepSpeed's per-node launcher, on the first rank it finds ended with an error (it then stops
# the others): "[...] [ERROR] [launch.py:259:sigkill_handler] [cmd] exits with return code = -9".
_RANK_ENDED = re.compile(rb"\[ERROR\] \[launch\.py:\d+:sigkill_handler\] (.*) exits with return code = (-?\d+)\s*$")
# A rank's one line for an error it did not expect (integrations.bootstrap.FAILED).
_RANK_FAILED = re.compile(rb"^offloadctl: rank (\d+) failed: (.*?)\s*$")
# A rank's line as it unwinds from a signal (integrations.bootstrap): when one rank fails, DeepSpeed's
# launcher stops the others with SIGTERM, and each says so, on its own pipe, in any order
# with the launcher's report of the failure. The run's one line says it all.
_RANK_STOPPED = re.compile(rb"^offloadctl: rank (\d+) (stopped by [A-Z]+);")
# gloo's threads torn down by a rank's exit after a peer has gone.
_TEARDOWN = (b"terminate called without an active exception",)
# DeepSpeed's per-node launcher signalled again as it exits (Ctrl-C reaches it from the terminal
# and offloadctl's SIGTERM follows): its handler, sigkill_handler, which ends in sys.exit, runs
# again inside the interpreter's shutdown, and Python prints the SystemExit as a block:
# "Exception ignored in: <module 'threading' ...>", a traceback through launch.py's
# sigkill_handler, "SystemExit: 1". The run's own line already says how it stopped.
_EXIT_NOISE_START = b"Exception ignored in: <module 'threading'"
_EXIT_NOISE_FRAME = re.compile(rb'deepspeed/launcher/launch\.py", line \d+, in sigkill_handler')
_BLOCK_MAX_LINES = 40
# torch's own log lines (torchrun, torch.distributed.elastic, c10d), in glog's format:
# "W1201 19:39:24.514000 8343 .../torch/distributed/run.py:874] Setting OMP_NUM_THREADS ...".
_TORCH_LOG_LINE = re.compile(rb"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\n]*\] ?")
_TORCH_LOG_TEMPLATE = b"I0000 00:00:00.000000 "
_TORCH_LOG_REST = re.compile(rb" *\d*( [^\]\n]*)?")
# torch elastic's report of the first rank it found ended: "... failed (exitcode: 1) local_rank: 1 (pid: ...".
_ELASTIC_FAILED = re.compile(rb"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# A traceback, held whole with the exceptions chained to it, to decide where it goes.
_TRACEBACK_START = b"Traceback (most recent call last):"
_CHAINED = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)
_TRACEBACK_MAX_LINES = 1000
_LOGGING_ERROR = b"--- Logging error ---"
"""How Python's logging begins its report of a record a handler failed to write (a stop signal
raised inside torch elastic's logger as it writes): a traceback, the call stack, the record."""
# A launcher's own traceback (torchrun, torch elastic's agent, Accelerate's launch): the ranks'
# failure or the stop it reports is the run's one line; its page goes to the log.
_LAUNCHER_FRAME = re.compile(
    rb'(torch/distributed/(run|launch)\.py|torch/distributed/elastic/[^"]*|accelerate/commands/'
    rb'(launch|accelerate_cli)\.py)", line \d+'
)
_ELASTIC_TABLE_RANK = re.compile(rb"^\s+rank\s+: (\d+) \(local_rank: (\d+)\)")
_ELASTIC_TABLE_EXIT = re.compile(rb"^\s+exitcode\s+: (-?\d+)")
# The rendezvous store's bind failing: a port another run (or program) holds.
_PORT_IN_USE = re.compile(rb"port: (\d+),.*EADDRINUSE|EADDRINUSE.*port (\d+)|address already in use.*:(\d+)")
_LEVELS = (b"DEBUG", b"INFO", b"WARNING") + _SHOWN_LEVELS
_OURS = b"offloadctl: "
"""How offloadctl's own lines begin (a rank's, or this process's)."""


def log_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOG_NAME)


def open_log(run_dir: str):
    """The run's DeepSpeed log, opened for appending (every process of the run appends lines);
    private to its user (0600: it holds the script's command line)."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    return open(log_path(run_dir), "ab", buffering=0, opener=private_opener)


# -- on the launcher's output -----------------------------------------------------------------


class RankFailures:
    """What the launcher's output says of ranks that failed: the first rank DeepSpeed's launcher
    found ended with an error (then it stops the others), and each rank's one line."""

    def __init__(self) -> None:
        self.first: tuple[int, int] | None = None
        """(local rank, return code: negative for a signal) of the first rank found ended."""
        self.lines: dict[int, str] = {}
        self.port_in_use: int | None = None
        """The rendezvous port a rank or launcher found in use (EADDRINUSE), once seen."""

    def elastic(self, line: bytes) -> None:
        """torch elastic's report of a rank found ended (its log line, or its table's rows)."""
        m = _ELASTIC_FAILED.search(line)
        if m and self.first is None:
            self.first = (int(m.group(2)), int(m.group(1)))

    def port(self, line: bytes) -> None:
        m = _PORT_IN_USE.search(line)
        if m and self.port_in_use is None:
            self.port_in_use = int(next(g for g in m.groups() if g))

    @property
    def refused(self) -> bool:
        """Whether the first rank ended with the ranks' one-line refusal (status 2)."""
        return self.first is not None and self.first[1] == 2

    def ended(self, line: bytes) -> bool:
        m = _RANK_ENDED.search(line)
        if not m:
            return False
        rank = re.search(rb"--local_rank=(\d+)", m.group(1))
        if self.first is None:
            self.first = (int(rank.group(1)) if rank else -1, int(m.group(2)))
        return True

    def failed(self, line: bytes) -> bool:
        """Whether ``line`` is a rank's line of its end (its error, or the signal it unwound
        from): for the log, and for the run's last line should that rank be the first ended."""
        m = _RANK_FAILED.match(line) or _RANK_STOPPED.match(line)
        if m:
            self.lines.setdefault(int(m.group(1)), m.group(2).decode(errors="replace"))
            self.port(line)
        return bool(m)

    def summary(self, log: str) -> str | None:
        """The run's last line: which rank failed first, how, its line, where the full log is."""
        if self.port_in_use is not None:
            return (
                f"offloadctl: the rendezvous port {self.port_in_use} is in use on this machine (another run, or "
                f"another program): give a free one (--master_port); the full log is in {log}"
            )
        if self.first is None or self.first[1] == 2:  # 2: the rank's one-line error (OffloadError) said it all
            return None
        rank, code = self.first
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        who = f"rank {rank}" if rank >= 0 else "a rank"
        line = self.lines.get(rank)
        return f"offloadctl: {who} failed first, {how}{': ' + line if line else ''}; the full log is in {log}"


class OutputFilter:
    """Sorts one byte stream into the terminal and the log, line by line, as it arrives.

    A partial line is passed on at once (progress bars redraw without a newline) unless its
    beginning could still become a DeepSpeed line; those are held until their newline.

    A failed rank's lines (its one line, DeepSpeed's launcher's report of it, gloo's teardown)
    go to the log and into ``failures``: the run ends with one line for them."""

    def __init__(
        self, shown, log, *, verbose: bool = False, failures: RankFailures | None = None, said: set | None = None
    ) -> None:
        self.shown, self.log, self.verbose = shown, log, verbose
        self.failures = failures if failures is not None else RankFailures()
        self.said = said if said is not None else set()
        """offloadctl's lines shown so far: the same line from another rank (a config every rank
        refuses, a warning every rank gives) goes to the log, not to the terminal again."""
        self._held = b""
        self._passing = False  # in the middle of a line already passed on
        self._block: list[bytes] | None = None  # a Python "Exception ignored" block, held whole
        self._traceback: list[bytes] | None = None  # a traceback and those chained to it, held whole
        self._traceback_part = "frames"  # where in it: 'frames', 'after' its exception line, 'chained', 'table'
        self.hidden_lines = 0

    def feed(self, data: bytes) -> None:
        buf = self._held + data
        self._held = b""
        while buf:
            nl = buf.find(b"\n")
            if self._passing:
                inside = _DS_LOG_INSIDE.search(buf, 0, len(buf) if nl < 0 else nl + 1)
                if inside:  # the line shown so far stays as it is; the log line starts here
                    self._show(buf[: inside.start()])
                    buf, self._passing = buf[inside.start() :], False
                    continue
                if nl < 0:  # the tail may be a log line's first bytes (a pty can hand a write over in pieces)
                    cut = self._log_start(buf)
                    self._show(buf[:cut])
                    self._held = buf[cut:]
                    return
                part, buf = buf[: nl + 1], buf[nl + 1 :]
                self._show(part)
                self._passing = False
                continue
            if nl < 0:
                if self._undecided(buf) or self._block is not None or self._traceback is not None:
                    self._held = buf
                else:  # as above: the tail may be a log line's first bytes after others on its line
                    cut = self._log_start(buf)
                    self._show(buf[:cut])
                    self._held = buf[cut:]
                    self._passing = True
                return
            line, buf = buf[: nl + 1], buf[nl + 1 :]
            if self._in_block(line) or self._in_traceback(line):
                continue
            inside = _DS_LOG_INSIDE.search(line, 1)
            if inside and not _DS_LOG_LINE.match(line.lstrip(b"\r")):
                # bytes before a log line on its line (a stopped progress bar's last escape codes,
                # written by a rank in the same read as the launcher's line): shown; the rest logged
                self._show(line[: inside.start()])
                line = line[inside.start() :]
            if self.is_deepspeed(line):
                self.hidden_lines += 1
                self._log(line)
                if self.verbose:
                    self._show(line)
            elif self._said_already(line):
                self._log(line)
            else:
                self._show(line)

    def close(self) -> None:
        if self._traceback is not None:
            self._end_traceback()
        if self._block is not None:
            for line in self._block:
                self._show(line)
            self._block = None
        if self._held:
            held, self._held = self._held, b""
            (self._log if self.is_deepspeed(held) and not self.verbose else self._show)(held)

    def _in_block(self, line: bytes) -> bool:
        """Whether ``line`` is taken into the held block (its start, a frame, its end). A block
        ending in SystemExit raised in DeepSpeed's launcher's handler goes to the log; any other
        is shown as it came, and the line after it is sorted as usual."""
        text = line.lstrip(b"\r")
        if self._block is None:
            if not text.startswith(_EXIT_NOISE_START):
                return False
            self._block = [line]
            return True
        if (text[:1] in (b" ", b"\t") or text.startswith(b"Traceback (most recent call last):")) and len(
            self._block
        ) < _BLOCK_MAX_LINES:
            self._block.append(line)
            return True
        block, self._block = self._block, None
        if text.startswith(b"SystemExit") and any(_EXIT_NOISE_FRAME.search(b) for b in block):
            for b in block + [line]:
                self.hidden_lines += 1
                self._log(b)
                if self.verbose:
                    self._show(b)
            return True
        for b in block:
            self._show(b)
        return False

    def _in_traceback(self, line: bytes) -> bool:
        """Whether ``line`` is taken into the held traceback (see :meth:`_end_traceback`)."""
        text = line.lstrip(b"\r")
        if self._traceback is None:
            if text.rstrip() == _LOGGING_ERROR:  # logging's own report of a record it could not write
                self._traceback, self._traceback_part = [line], "logging"
                return True
            if not text.startswith(_TRACEBACK_START):
                return False
            self._traceback, self._traceback_part = [line], "frames"
            return True
        part, bare = self._traceback_part, text.strip()
        if text.startswith(_OURS) or _TORCH_LOG_LINE.match(text) or _DS_LOG_LINE.match(text):
            # another process's line, written into this one's traceback (every process of the
            # run shares the stream: a rank says it stopped while torchrun prints its page):
            # sorted as usual, and the traceback goes on after it
            return False
        if len(self._traceback) >= _TRACEBACK_MAX_LINES:
            taken = False
        elif part == "logging":  # "--- Logging error ---", then its traceback
            taken = text.startswith(_TRACEBACK_START)
            self._traceback_part = "frames"
        elif part == "call stack":  # after logging's traceback: the call stack, the record's message
            taken = text[:1] in (b" ", b"\t") or text.startswith((b"Message: ", b"Arguments: "))
        elif part == "frames":
            taken = True
            if text[:1] not in (b" ", b"\t") and bare:
                # the exception's line; a blank line among the frames is another process's
                # newline (a rank's, written apart from its line) and changes nothing
                self._traceback_part = "after"
        elif part in ("after", "chained"):
            # what follows its exception's line: blank lines, the line that chains the next
            # traceback to it (then that traceback), or torch elastic's table of failures
            taken = (
                not bare
                or bare in _CHAINED
                or (part == "chained" and text.startswith(_TRACEBACK_START))
                or (bare.startswith(b"=" * 20) and b"ChildFailedError" in self._traceback[-1])
                or (bare == b"Call stack:" and self._traceback[0].strip() == _LOGGING_ERROR)
            )
            if not taken:
                pass
            elif bare == b"Call stack:":
                self._traceback_part = "call stack"
            elif bare in _CHAINED:
                self._traceback_part = "chained"
            elif text.startswith(_TRACEBACK_START):
                self._traceback_part = "frames"
            elif bare.startswith(b"=" * 20):
                self._traceback_part = "table"
        else:  # torch elastic's table of failures, between two lines of '='
            taken = True
            if bare.startswith(b"=" * 20):
                self._traceback.append(line)
                self._end_traceback()
                return True
        if taken:
            self._traceback.append(line)
            return True
        self._end_traceback()
        return self._in_block(line) or self._in_traceback(line)

    def _end_traceback(self) -> None:
        """A launcher's traceback (a frame in torchrun, torch elastic or Accelerate's launch: the
        ranks' failure or a stop it reports), or a rank's whose error is a rendezvous port in
        use, goes to the log, and what it says of the failed rank to ``failures``; any other
        is shown as it came."""
        lines, self._traceback = self._traceback or [], None
        launcher = any(_LAUNCHER_FRAME.search(x) for x in lines)
        for x in lines:
            self.failures.port(x)
        if not (launcher or any(b"EADDRINUSE" in x for x in lines)):
            for x in lines:
                self._show(x)
            return
        rank = next((int(m.group(2)) for m in map(_ELASTIC_TABLE_RANK.match, lines) if m), None)
        code = next((int(m.group(1)) for m in map(_ELASTIC_TABLE_EXIT.match, lines) if m), None)
        if rank is not None and code is not None and self.failures.first is None:
            self.failures.first = (rank, code)
        for x in lines:
            self.hidden_lines += 1
            self._log(x)
            if self.verbose:
                self._show(x)

    def is_deepspeed(self, line: bytes) -> bool:
        text = line.lstrip(b"\r")
        if self.failures.ended(text) or self.failures.failed(text) or text.rstrip().endswith(_TEARDOWN):
            return True
        if _TORCH_LOG_LINE.match(text):  # torch's launcher and c10d: the log, as DeepSpeed's
            self.failures.elastic(text)
            self.failures.port(text)
            return True
        m = _DS_LOG_LINE.match(text)
        if m:
            return m.group(1) not in _SHOWN_LEVELS
        if _DS_PRINTS.match(text):
            return True
        return False

    @staticmethod
    def _log_start(buf: bytes) -> int:
        """Where a DeepSpeed log line may begin at the end of ``buf`` (a '[' from which the rest
        is a prefix of one, or a whole log line's start), else ``len(buf)``."""
        whole = _DS_LOG_INSIDE.search(buf)
        if whole:
            return whole.start()
        n = len(_DS_LOG_TEMPLATE) + 12
        start = max(0, len(buf) - n)
        for i in range(start, len(buf)):
            if buf[i : i + 1] != b"[":
                continue
            rest = buf[i:]
            if all((t == 0x30 and c in b"0123456789") or t == c for t, c in zip(_DS_LOG_TEMPLATE, rest)):
                tail = rest[len(_DS_LOG_TEMPLATE) :]
                if len(rest) <= len(_DS_LOG_TEMPLATE) or any((lv + b"] ").startswith(tail) for lv in _LEVELS):
                    return i
        return len(buf)

    def _said_already(self, line: bytes) -> bool:
        text = line.lstrip(b"\r").rstrip()
        if not text.startswith(_OURS) or _RANK_FAILED.match(text):
            return False
        if text in self.said:
            return True
        self.said.add(text)
        return False

    def _undecided(self, partial: bytes) -> bool:
        """Whether the start of a line, ``partial``, could still become a line for the log."""
        text = partial.lstrip(b"\r")
        n = len(_DS_LOG_TEMPLATE)
        if all((t == 0x30 and c in b"0123456789") or t == c for t, c in zip(_DS_LOG_TEMPLATE, text)):
            rest = text[n:]
            if any((level + b"] ").startswith(rest) or rest.startswith(level + b"] ") for level in _LEVELS):
                return True
        if (_OURS.startswith(text) or text.startswith(_OURS)) and len(text) < 2000:
            return True  # offloadctl's own line: whole, to show it once (python -u writes its newline apart)
        if (_EXIT_NOISE_START.startswith(text) or text.startswith(_EXIT_NOISE_START)) and len(text) < 500:
            return True  # may start a block held whole (_in_block)
        if _TRACEBACK_START.startswith(text.rstrip(b"\r")) or _LOGGING_ERROR.startswith(text) or _torch_log_prefix(text):
            return True  # a traceback's start (held whole), or torch's log line
        starts = _DS_PRINT_STARTS + (b"terminate called",)
        return any(s.startswith(text) or text.startswith(s) for s in starts) and len(text) < 200

    def _show(self, data: bytes) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.shown.write(data)
            self.shown.flush()

    def _log(self, data: bytes) -> None:
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.write(data.replace(b"\r\n", b"\n"))


def _torch_log_prefix(text: bytes) -> bool:
    """Whether ``text`` (a line so far) may still become one of torch's log lines."""
    t = text[1:] if text.startswith(b"[") else text
    if not t or t[:1] not in b"IWEF" or len(text) > 4000:
        return False
    if _TORCH_LOG_LINE.match(text):
        return True
    for h, c in zip(_TORCH_LOG_TEMPLATE[1:], t[1:]):
        if (h == 0x30 and c not in b"0123456789") or (h != 0x30 and h != c):
            return False
    return len(t) <= len(_TORCH_LOG_TEMPLATE) or bool(_TORCH_LOG_REST.fullmatch(t[len(_TORCH_LOG_TEMPLATE) :]))


class LauncherOutput:
    """The launcher's stdout and stderr, each through an :class:`OutputFilter` on a thread.

    Where our own stdout/stderr is a terminal the launcher gets a pseudo-terminal of the same
    size, so the script sees a terminal as it would without us (progress bars, colours)."""

    def __init__(self, run_dir: str, *, verbose: bool = False) -> None:
        self.log = open_log(run_dir)
        self.path = log_path(run_dir)
        self.verbose = verbose
        self._pairs: list[tuple[int, int]] = []  # (our read end, the child's end)
        self.filters: list[OutputFilter] = []
        self._threads: list[threading.Thread] = []
        self.failures = RankFailures()
        self._said: set[bytes] = set()

    def child_fds(self) -> tuple[int, int]:
        """The child's stdout and stderr (close them in the parent once it has started)."""
        ends = []
        for ours in (sys.stdout, sys.stderr):
            r, w = _terminal_pair(ours) if _isatty(ours) else os.pipe()
            self._pairs.append((r, w))
            ends.append(w)
            self.filters.append(
                OutputFilter(_binary(ours), self.log, verbose=self.verbose, failures=self.failures, said=self._said)
            )
        return ends[0], ends[1]

    def started(self) -> None:
        for _, child_end in self._pairs:
            os.close(child_end)
        for (r, _), f in zip(self._pairs, self.filters):
            t = threading.Thread(target=_filter_until_eof, args=(r, f), daemon=True, name="offloadctl-output")
            t.start()
            self._threads.append(t)

    def close(self, timeout: float = 5.0) -> None:
        """Wait until both streams end (every process holding them is gone), then close the log."""
        for t in self._threads:
            t.join(timeout)
        for f in self.filters:
            f.close()
        with contextlib.suppress(OSError):
            self.log.close()

    @property
    def hidden_lines(self) -> int:
        return sum(f.hidden_lines for f in self.filters)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _binary(stream):
    return getattr(stream, "buffer", stream)


def _terminal_pair(like) -> tuple[int, int]:
    """A pseudo-terminal (our end, the child's end) with the size of the terminal ``like``."""
    import fcntl
    import pty
    import termios

    ours, child = pty.openpty()
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(like.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(child, termios.TIOCSWINSZ, size)
    return ours, child


def _filter_until_eof(fd: int, out: OutputFilter) -> None:
    """Feed what the ranks write to ``fd`` through ``out`` until every writer has gone; then close ``fd``."""
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: a pseudo-terminal whose every writer has gone
                break
            if not data:
                break
            out.feed(data)
    finally:
        os.close(fd)
