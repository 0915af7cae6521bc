"""The tuner daemon (issue 5): watches iteration telemetry and drives ``engine.Knobs``.

- :mod:`tuner.protocol`: the wire format (versioned, length-prefixed JSON, schemas, error codes);
- :mod:`tuner.server`: the daemon (many runs, many ranks per run, one asyncio loop);
- :mod:`tuner.client`: the engine side (``TunerClient``: telemetry out, knob changes in);
- :mod:`tuner.service`: socket paths, starting and stopping a daemon, ``ensure_daemon``;
- :mod:`tuner.policy`, :mod:`tuner.sensors`, :mod:`tuner.history`: what to change, what the
  machine does, and what worked before.
"""
