"""Where the engine meets other software: DeepSpeed ZeRO-3, the per-rank bootstrap, the launcher."""
