"""Installs offloadctl's engine in every Python process DeepSpeed's own unit tests start.

DeepSpeed's test harness (``tests/unit/common.py``, ``DistributedTest``) runs each test in worker
processes it starts with ``forkserver`` or ``spawn``: new interpreters, which run this module at
start-up when its directory is on ``PYTHONPATH``. With ``OFFLOADCTL_ENGINE_SETTINGS`` set (the JSON
of :class:`integrations.deepspeed_zero3.ZeroEngineSettings`), each installs the engine before any
test code runs, as ``offloadctl train``'s bootstrap does in a rank. Used by
``tests/test_deepspeed_unit_tests.py``; inert without the variable.
"""

import json
import os

_settings = os.environ.get("OFFLOADCTL_ENGINE_SETTINGS")
if _settings:
    from integrations.deepspeed_zero3 import ZeroEngineSettings, install

    install(ZeroEngineSettings.from_json(json.loads(_settings)))
