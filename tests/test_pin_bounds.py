"""A pin past the wire's bounds: refused by the daemon before it keeps it, in one line from
``offloadctl tune``; the run's later pins and pushes go on as before. (Kept, every later push
would fail the ranks' schema check, and a later valid pin would read as an error.) A real daemon
on its own socket, a real rank client, the real CLI."""

from __future__ import annotations

import logging
import os
import re

import pytest
from helpers import cli, wait_for


def _runs(sock: str) -> list[dict]:
    from tuner.protocol import Connection

    with Connection(sock) as c:
        return c.request("snapshot", history=0)["runs"]


@pytest.mark.parametrize("weight", ["1e308", "2e15"])
def test_a_pin_past_the_wires_bounds_is_refused_and_the_run_goes_on(weight, tmp_path, caplog):
    """A stripe weight is any finite number >= 0 to the engine, and at most 1e15 on the wire (the
    other knobs' ranges are within the wire's)."""
    from engine.config import Knobs
    from tuner import service
    from tuner.client import TunerClient
    from tuner.run_state import RunFacts

    nvme = str(tmp_path / "nvme")
    os.makedirs(nvme)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    knob, value = "stripe_weights", f'{{"{nvme}": {weight}}}'
    run = f"r{os.getpid()}-{weight}"  # the session's history keeps a run's pins by its id
    sock, stop = service.ensure_daemon(str(tmp_path / "no-system.sock"), run_dir=run_dir)
    rank = TunerClient(sock, RunFacts(params=1000, paths=(nvme,), subgroup_bytes=12000), Knobs(), run_id=run, rank=0)
    try:
        assert rank.connected.wait(20)
        wait_for(lambda: _runs(sock), 20, "the run to register")
        r = cli("tune", "--socket", sock, "--pin", f"{run}:{knob}={value}", timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stdout + r.stderr
        assert re.fullmatch(
            rf"offloadctl: --pin {re.escape(run)}:{re.escape(knob)}=.*: cannot pin {re.escape(knob)}=.*: knobs\."
            r".* must be .*, got .*, the protocol's bound that every rank checks\n",
            r.stderr,
        ), r.stderr
        assert _runs(sock)[0]["pins"] == {} and rank.pending_changes() == []
        # A valid pin after it: applied, said as applied, and pushed to the rank in a message it takes.
        with caplog.at_level(logging.WARNING, logger="offloadctl"):
            r = cli("tune", "--socket", sock, "--pin", f"{run}:prefetch_depth=3", timeout=60)
            assert r.returncode == 0 and r.stderr == "" and "prefetch_depth" in r.stdout, r.stdout + r.stderr
            wait_for(lambda: rank.pending_changes(), 20, "the pin's push to reach the rank")
        assert rank.pending_changes()[-1]["knobs"].prefetch_depth == 3
        assert not [m.getMessage() for m in caplog.records if "bad message" in m.getMessage()]
        assert _runs(sock)[0]["pins"] == {"prefetch_depth": 3}
    finally:
        rank.close()
        stop()
