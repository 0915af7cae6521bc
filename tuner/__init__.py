"""The tuner daemon: watches iteration telemetry and drives ``engine.Knobs``.

- :mod:`tuner.protocol`: the wire format (versioned, length-prefixed JSON, schemas, error codes);
- :mod:`tuner.server`: the daemon's transport (socket, connections, frames, limits; one asyncio loop),
  configured by :mod:`tuner.daemon_config`;
- :mod:`tuner.runs`: the daemon's runs (ranks, aggregation, the policy, knob changes, pins), their
  state and views in :mod:`tuner.run_state`;
- :mod:`tuner.client`: the engine side (``TunerClient``: telemetry out, knob changes in);
- :mod:`tuner.service`: socket paths, starting and stopping a daemon, ``ensure_daemon``;
- :mod:`tuner.policy`, :mod:`tuner.sensors`, :mod:`tuner.history`: what to change, what the
  machine does, and what worked before.
"""
