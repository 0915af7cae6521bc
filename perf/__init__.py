"""Hardware profiles, their measurement, the performance model and planning."""
