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

Hugging Face notes. Trainer and Accelerate reach the engine with no code of ours in them:
both end in ``deepspeed.initialize``, which builds the optimizer class ``install()`` put in
place. Accelerate takes its DeepSpeed path only with ``ACCELERATE_USE_DEEPSPEED=true``, which
the launcher sets as ``accelerate launch --use_deepspeed`` would. Trainer attaches its LR
scheduler to the optimizer DeepSpeed wraps; that optimizer holds no parameters here (the
engine owns them), and the ZeRO-3 subclass still calls its ``step()`` so the scheduler's step
tracking and any step hooks on it run. ``ds_patches`` wraps the DeepSpeed engine's
``forward``, ``backward`` and ``step`` for the recorder as instance attributes, which Trainer and
Accelerate call, so their phases are recorded too (``tests/test_deepspeed_integration.py`` runs both against stock
DeepSpeed).
"""
