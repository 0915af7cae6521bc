"""Where the engine meets other software: DeepSpeed ZeRO-3, the per-rank bootstrap, the launcher.

- ``settings``: ``RankSettings``, what ``offloadctl train`` hands each rank (the engine's
  ``ZeroEngineSettings``, the recorder's config), one JSON each way.
- ``deepspeed_zero3``: ``install()``, which puts ``zero3_optimizer.OffloadZero3Optimizer`` in
  place of DeepSpeed's ZeRO-3 optimizer before ``deepspeed.initialize``.
- ``ds_patches``: every change made to DeepSpeed's objects (``deepspeed.initialize``, the
  optimizer class, ``load_checkpoint``, the recorder's hooks); ``ds_compat`` checks every
  DeepSpeed internal that they and the subclass rely on.
- ``bootstrap``: what each rank runs before the user's script; ``launcher``: the DeepSpeed
  launcher's command line and environment, signals, and ``/dev/shm`` clean-up.

Hugging Face: Trainer and Accelerate reach the engine with no code of ours in them, since both
end in ``deepspeed.initialize`` (Accelerate only with ``ACCELERATE_USE_DEEPSPEED=true``, which
the launcher sets as ``accelerate launch --use_deepspeed`` would). The ZeRO-3 subclass still calls
the ``step()`` of the optimizer DeepSpeed wraps (it holds no parameters here), so Trainer's LR
scheduler and step hooks run; the recorder's wrappers of ``forward``, ``backward`` and ``step``
are instance attributes, which both call (``tests/test_deepspeed_integration.py`` runs both).
"""
