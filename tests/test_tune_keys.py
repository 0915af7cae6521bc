"""The live view's keys, read without a terminal or a daemon: what each key does to the run
shown (:class:`offloadctl.commands.tune.Controls`), the requests it sends and the line under
the frame; and the lines `offloadctl train` ends a launch with (``train_text``). The tmux tests
(test_tune_words, test_user_view_runs) drive the same keys through a real terminal."""

from __future__ import annotations

from types import SimpleNamespace

from offloadctl.commands.train_text import ending_note
from offloadctl.commands.tune import Controls
from offloadctl.commands.tune_keys import Keys
from tuner.protocol import ErrorCode, ProtocolError


class Daemon:
    """A connection that keeps the requests sent; ``refuse``: the daemon's error for each."""

    def __init__(self, refuse: str | None = None) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.refuse = refuse

    def request(self, kind: str, **fields) -> dict:
        self.sent.append((kind, fields))
        if self.refuse:
            raise ProtocolError(ErrorCode.SCHEMA, self.refuse)
        return {}


RUN = {"run_id": "r1", "status": "running", "frozen": False}


def test_keys_pin_unpin_and_freeze_the_run_shown():
    conn = Daemon()
    c = Controls(conn)
    c.keys("p", [RUN])
    assert c.prompt == "pin" and str(c.legend([RUN])).startswith("pin KNOB=VALUE: _")
    c.keys("prefetch_depth=4\r", [RUN])
    assert conn.sent == [("pin", {"run_id": "r1", "knob": "prefetch_depth", "value": 4})]
    assert c.prompt is None and c.sent and c.message == "pinned prefetch_depth=4"
    c.keys("unode_lock\r", [RUN])
    assert conn.sent[-1] == ("unpin", {"run_id": "r1", "knob": "node_lock"})
    assert c.message == "unpinned node_lock: the tuner may move it"
    c.keys("f", [RUN])
    assert conn.sent[-1] == ("freeze", {"run_id": "r1", "frozen": True})
    assert c.message == "frozen: tuning stopped, knobs held"
    c.keys("f", [{**RUN, "frozen": True}])
    assert conn.sent[-1] == ("freeze", {"run_id": "r1", "frozen": False})
    assert str(c.legend([{**RUN, "frozen": True}])).startswith("q quit  p pin  u unpin  f unfreeze  ? help  unfrozen")


def test_keys_typed_wrong_are_answered_and_send_nothing():
    conn = Daemon()
    c = Controls(conn)
    c.keys("pprefech_depth=4\r", [RUN])  # mistyped: the nearest knob, in the prompt's form
    assert conn.sent == [] and "no knob 'prefech_depth' (did you mean prefetch_depth?)" in c.message
    c.keys("pprefetch_depth=4\x7f5\x1b", [RUN])  # Backspace, then Esc cancels
    assert conn.sent == [] and c.prompt is None and c.message == "cancelled"
    c.keys("x", [RUN])
    assert c.message == "no key 'x': ? shows the keys"
    c.keys("p", [RUN, {**RUN, "run_id": "r2"}])
    assert c.prompt is None and c.message.startswith("2 runs: pin or freeze one from a view of it alone")
    c.keys("f", [{**RUN, "status": "finished"}])
    assert conn.sent == [] and c.message == "no running run here"
    c.keys("?", [RUN])
    assert c.help and "keys of the live view" in str(c.help_text()) and "prefetch_depth" in str(c.help_text())
    c.keys("q?", [RUN])  # q leaves at once: what follows it is not read
    assert c.quit and c.help


def test_a_request_the_daemon_refuses_is_said_in_the_knobs_words():
    c = Controls(Daemon(refuse="Knobs.prefetch_depth must be at most 8"))
    c.keys("pprefetch_depth=4\n", [RUN])
    assert c.message == "prefetch_depth must be at most 8" and not c.sent


def test_keys_without_a_terminal_read_nothing():
    with Keys(SimpleNamespace(isatty=lambda: False)) as keys:
        assert not keys.active and keys.read(0.0) == ""


def _output(summary: str | None = None, refused: bool = False, hidden: int = 3):
    failures = SimpleNamespace(summary=lambda path: summary, refused=refused)
    return SimpleNamespace(failures=failures, hidden_lines=hidden, path="/run/deepspeed.log")


def test_a_launch_ends_with_the_line_that_says_why():
    import signal

    assert ending_note(130, signal.SIGINT, _output("rank 0 failed"), verbose=False) == (
        "offloadctl: stopped by SIGINT: ranks stopped, their swap files removed"
    )
    assert ending_note(1, None, _output("offloadctl: rank 3 failed first"), verbose=False) == "offloadctl: rank 3 failed first"
    assert ending_note(0, None, _output("offloadctl: rank 3 failed first"), verbose=False) is None
    assert ending_note(1, None, _output(), verbose=False) == (
        "offloadctl: the run failed (exit status 1); DeepSpeed's log is in /run/deepspeed.log"
    )
    assert ending_note(2, None, _output(), verbose=False) is None  # the ranks' one-line error said it all
    assert ending_note(1, None, _output(), verbose=True) is None  # the log's lines were shown
    assert ending_note(1, None, _output(refused=True), verbose=False) is None
    assert ending_note(1, None, _output(hidden=0), verbose=False) is None
