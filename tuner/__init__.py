"""The tuner daemon (issue 5): watches iteration telemetry and drives ``engine.Knobs``."""
