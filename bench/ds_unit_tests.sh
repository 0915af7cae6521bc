#!/usr/bin/env bash
# DeepSpeed's own unit tests (tests/test_deepspeed_unit_tests.py) need DeepSpeed's repository at
# the pinned commit: not in its PyPI release, and none of it is committed here. This makes a
# checkout of its tests/ from a git directory of deepspeedai/DeepSpeed (the library's `fetch`
# gives one: /work/.mirror/deepspeedai+DeepSpeed/repo), then runs the tests with the engine:
#
#   bash bench/ds_unit_tests.sh GIT_DIR [OUT_DIR]       # default OUT_DIR: /var/tmp/deepspeed-src
set -euo pipefail
git_dir=${1:?usage: ds_unit_tests.sh GIT_DIR [OUT_DIR]}
out=${2:-/var/tmp/deepspeed-src}
cd "$(dirname "$0")/.."
commit=$(sed -n 's/^PINNED_COMMIT = "\([0-9a-f]*\)"/\1/p' tests/test_deepspeed_unit_tests.py)
rm -rf "$out" && mkdir -p "$out"
git --git-dir="$git_dir" archive "$commit" tests | tar -x -C "$out"
echo "DeepSpeed tests at $commit in $out"
OFFLOADCTL_DEEPSPEED_SRC="$out" .venv/bin/python -m pytest -q tests/test_deepspeed_unit_tests.py "${@:3}"
