# Fresh-machine set-up. `make demo` and `make test` both run `make setup` first; every step
# is idempotent, so running them again only re-checks.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.offloadctl-setup
# torch goes in first: the CPU wheel where there is no CUDA, so nothing later pulls the CUDA build.
TORCH_CPU := torch==2.13.0
# The supported DeepSpeed range is pyproject.toml's (integrations/ds_compat.py reads it from the
# installed metadata): taken from there, so that it is written in one place.
DS_REQ  := $(shell sed -n 's/^ *"\(deepspeed[^"]*\)".*/\1/p' pyproject.toml)

.PHONY: setup demo test quick golden bench clean-venv
setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch; \
	else \
	    $(VPY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
	      || $(VPY) -m pip install -q $(TORCH_CPU); \
	fi
	@if [ "$$(id -u)" = 0 ] && ! [ -e /usr/include/libaio.h ] && command -v apt-get >/dev/null; then \
	    echo "setup: installing libaio-dev (DeepSpeed async_io)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null \
	      || echo "setup: libaio-dev not installed; the engine will use its posix O_DIRECT backend"; \
	fi
	@$(VPY) -c "import deepspeed" 2>/dev/null || $(VPY) -m pip install -q --no-build-isolation '$(DS_REQ)'
	@$(VPY) -m pip install -q --no-build-isolation -e '.[test]'
	@# DeepSpeed's native ops: built here, once, with progress (minutes); runs never compile them,
	@# whether or not the venv is activated (engine/storage/native_ops.py). It also checks the
	@# installed DeepSpeed against the internals the ZeRO-3 integration uses, and fails here with
	@# one line if they differ (the stamp is not written, so the next `make setup` checks again).
	@$(VENV)/bin/offloadctl info --build
	@touch $(STAMP)

# The main job: an unmodified DeepSpeed ZeRO-3 script under `offloadctl train`, all optimizer
# state in an NVMe tier under a temporary directory (removed afterwards), its records in
# runs/demo (replaced at each demo), then the report of the run (plots of every iteration) in
# runs/demo-report.html: the last line it prints.
demo: setup
	@d=$$(mktemp -d "$${TMPDIR:-/var/tmp}/offloadctl-demo.XXXXXX"); trap 'rm -rf "$$d"' EXIT; \
	  $(VENV)/bin/offloadctl train --num_gpus 1 --nvme "$$d" --run-dir runs/demo --force examples/train_gpt.py --steps 30 && \
	  $(VENV)/bin/offloadctl report runs/demo --output runs/demo-report.html

# Three pytest workers (pytest-xdist) on two cores: a DeepSpeed launch spends much of its time in
# serial imports, rendezvous and the launcher's polls, so three overlap better than two (15-17
# minutes as the machine's speed varies, against 18 with two; about 40 in one process before
# the run cache and the golden stock runs). Each worker takes its own ports; the DeepSpeed runs
# several tests share are made once (tests/ds_runs.py), and so are the scenarios a module's
# tests share (the once fixture in tests/conftest.py).
test: setup
	$(VENV)/bin/python -m pytest -q -n 3 tests

# The quick loop: everything but real trainings, processes and signals (pytest -m "not slow").
quick: setup
	$(VENV)/bin/python -m pytest -q -n 3 -m "not slow" tests

# The stock DeepSpeed runs the tests read from tests/data/golden where this machine has what
# they were made with (tests/ds_runs.py): make them again after a DeepSpeed or torch upgrade.
golden: setup
	$(VENV)/bin/python tests/make_golden.py

bench: setup
	$(VENV)/bin/python bench/update_phase.py

clean-venv:
	rm -rf $(VENV)
