"""The check of the installed DeepSpeed against what the ZeRO-3 integration overrides and reads."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import types

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import engine.adamw
import engine.host_kernel
from engine.errors import ConfigError
from integrations import ds_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ds():
    from engine.storage.native_ops import import_deepspeed

    return import_deepspeed()


@pytest.fixture
def stage3(ds):
    import deepspeed.runtime.zero.stage3 as stage3

    return stage3.DeepSpeedZeroOptimizer_Stage3


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_installed_deepspeed_matches(ds):
    ds_compat.check_deepspeed()
    ds_compat.check_deepspeed(ds)
    assert ds_compat.integration_status() == f"ok (DeepSpeed {ds.__version__})"


@pytest.mark.parametrize(
    "name, replacement, found",
    [
        ("_post_step", lambda self: None, "found (self)"),  # a parameter dropped
        (
            "_offload_grad_partition_at_boundary",  # an overridden method DeepSpeed now calls with one more
            lambda self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets, extra: None,
            "found (self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets, extra)",
        ),
        ("_get_norm_groups", None, "found no such method"),
        ("_pre_step", staticmethod(lambda: None), "found a staticmethod"),
        ("_release_sub_group", None, "found no such method"),  # one the recorder's hooks wrap under --engine stock
    ],
)
def test_changed_method_is_one_line_naming_version_and_method(ds, stage3, monkeypatch, name, replacement, found):
    if replacement is None:
        monkeypatch.delattr(stage3, name)
    else:
        monkeypatch.setattr(stage3, name, replacement)
    expected = next(m for m in ds_compat.METHODS if m.name == name)
    signature = f"DeepSpeedZeroOptimizer_Stage3.{name}(self{''.join(', ' + p for p in expected.params)})"
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed()
    msg = _one_line(e)
    assert msg.startswith(
        f"DeepSpeed {ds.__version__} does not match offloadctl's ZeRO-3 integration: {signature} expected, {found}: "
    ), msg
    assert f"pip install 'deepspeed=={ds_compat.CHECKED_AGAINST}'" in msg


def test_every_private_name_the_patches_touch_is_checked():
    from integrations import ds_patches

    patched = [ds_compat.GET_OPTIMIZER_CONFIGURATION] + [m for m, _ in ds_patches.STOCK_UPDATE_PARTS]
    assert all(m in ds_compat.METHODS and m.use == "wrap" for m in patched)


def test_every_fault_is_counted_on_the_one_line(stage3, monkeypatch):
    monkeypatch.delattr(stage3, "_get_norm_groups")
    monkeypatch.setattr(stage3, "_post_step", lambda self: None)
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed()
    assert "(and 1 more: DeepSpeedZeroOptimizer_Stage3._post_step(self, timer_names) expected" in _one_line(e)


def test_the_class_install_puts_in_place_is_looked_through(ds, stage3, monkeypatch):
    # install() replaces the class in DeepSpeed's module by the subclass, whose overrides differ
    # from DeepSpeed's methods on purpose: a later check must still look at DeepSpeed's class.
    import deepspeed.runtime.zero.stage3 as module

    class Ours(stage3):
        def _offload_grad_partition_at_boundary(self, param, grad_buffer, *args):
            pass

    monkeypatch.setattr(module, "DeepSpeedZeroOptimizer_Stage3", Ours)
    ds_compat.check_deepspeed(ds)


@pytest.mark.parametrize("version", ["0.20.0", "0.19.7", "0.18.9", "0.20.0.dev0", "1.0.0"])
def test_version_outside_the_range_fails(version):
    fake = types.SimpleNamespace(__version__=version, __name__="deepspeed")
    req = ds_compat.supported_requirement()
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed(fake)
    assert _one_line(e) == (
        f"DeepSpeed {version} is outside offloadctl's supported range {req} (the ZeRO-3 "
        f"integration overrides internals of those versions): install a DeepSpeed version in "
        f"the supported range (pip install '{req}' --no-build-isolation)"
    )


@pytest.mark.parametrize("version", ["0.19.8", "0.19.9.dev0", "0.19.8+cpu"])
def test_version_inside_the_range_passes(version):
    ds_compat.check_deepspeed(types.SimpleNamespace(__version__=version, __name__="deepspeed"))


def test_attribute_deepspeed_no_longer_sets_fails(monkeypatch):
    monkeypatch.setattr(
        ds_compat, "ATTRIBUTES", (*ds_compat.ATTRIBUTES, ds_compat.Attribute(ds_compat.STAGE3, "fp32_flat_renamed"))
    )
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed()
    assert "DeepSpeedZeroOptimizer_Stage3.fp32_flat_renamed expected, found nothing in its source that sets it" in _one_line(e)


def test_attribute_deepspeed_takes_from_us_fails(monkeypatch):
    monkeypatch.setattr(ds_compat, "OWN_ATTRIBUTES", (*ds_compat.OWN_ATTRIBUTES, "partition_count"))
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed()
    assert (
        "DeepSpeedZeroOptimizer_Stage3.partition_count expected to be offloadctl's own, found DeepSpeed "
        "setting it too" in _one_line(e)
    )


def _live_optimizer():
    param = types.SimpleNamespace(ds_id=0, ds_numel=4, partition_numel=lambda: 4)
    opt = types.SimpleNamespace()
    for a in ds_compat.ATTRIBUTES:
        if a.live and a.owner == ds_compat.STAGE3:
            setattr(opt, a.name, None)
    opt.parameter_offload = types.SimpleNamespace(_max_available_parameters_in_numel=1)
    opt.fp16_groups = [[param]]
    return opt, param


def test_live_optimizer_with_every_attribute_passes():
    ds_compat.check_optimizer_instance(_live_optimizer()[0])


@pytest.mark.parametrize(
    "where, name",
    [
        ("opt", "grad_partitions_flat_buffer"),
        ("opt", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"),
        ("param", "partition_numel"),
        ("offload", "_max_available_parameters_in_numel"),
    ],
)
def test_live_optimizer_missing_an_attribute_is_one_line(ds, where, name):
    opt, param = _live_optimizer()
    delattr({"opt": opt, "param": param, "offload": opt.parameter_offload}[where], name)
    owner = {"opt": "DeepSpeedZeroOptimizer_Stage3", "param": "partition_parameters", "offload": "DeepSpeedZeRoOffload"}[where]
    with pytest.raises(ConfigError) as e:
        ds_compat.check_optimizer_instance(opt)
    msg = _one_line(e)
    assert msg.startswith(
        f"DeepSpeed {ds.__version__} does not match offloadctl's ZeRO-3 integration: "
        f"{owner}.{name} expected, found no such attribute on "
    ), msg


def test_the_range_is_pyprojects():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pin = next(d for d in deps if re.match(r"deepspeed\b", d))
    from packaging.requirements import Requirement

    assert Requirement(ds_compat.DEEPSPEED_REQUIREMENT).specifier == Requirement(pin).specifier
    # What the check uses: the installed metadata (the same pin), or the constant without it.
    assert Requirement(ds_compat.supported_requirement()).specifier == Requirement(pin).specifier
    assert Requirement(pin).specifier.contains(ds_compat.CHECKED_AGAINST)
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert "deepspeed>=" not in makefile and "$(DS_REQ)" in makefile  # make setup takes it from pyproject.toml


def test_the_fallback_without_package_metadata(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", missing)
    assert ds_compat.supported_requirement() == ds_compat.DEEPSPEED_REQUIREMENT


@pytest.mark.slow
def test_info_json_includes_the_check(ds):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "offloadctl.cli", "info", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["deepspeed_integration"] == f"ok (DeepSpeed {ds.__version__})"


def test_info_fails_with_the_one_line(stage3, monkeypatch, capsys):
    # What `make setup` runs (info --build): a mismatch is status 2, with the one line last on stderr.
    from offloadctl.commands import info

    monkeypatch.setattr(engine.adamw, "measure_host_kernels", lambda: {"torch": 1.0})
    monkeypatch.setattr(engine.host_kernel, "host_lane_rate", lambda name: 1.0)
    monkeypatch.setattr(stage3, "_post_step", lambda self: None)
    for as_json in (True, False):
        assert info.run(argparse.Namespace(json=as_json, build=False)) == 2
        out, err = capsys.readouterr()
        line = err.strip().splitlines()[-1]
        assert line.startswith("offloadctl: DeepSpeed ") and "_post_step(self, timer_names) expected" in line
        if as_json:
            assert json.loads(out)["deepspeed_integration"] == line[len("offloadctl: ") :]


def test_the_copied_partition_grads_is_the_installed_one():
    """The override of partition_grads copies DeepSpeed 0.19.8's body (less a PCIe round trip):
    the installed body must be the one copied."""
    ds_compat.copied_source_matches.cache_clear()
    assert ds_compat.copied_source_matches(ds_compat.STAGE3, "partition_grads")


def test_a_changed_body_runs_deepspeeds_own(stage3, monkeypatch):
    """A DeepSpeed whose partition_grads differs from the copy keeps its own (and any fix in it)."""
    from integrations.zero3_optimizer import OffloadZero3Optimizer

    calls = []
    monkeypatch.setattr(stage3, "partition_grads", lambda self, p, g: calls.append((p, g)) or ["theirs"])
    ds_compat.copied_source_matches.cache_clear()
    try:
        assert not ds_compat.copied_source_matches(ds_compat.STAGE3, "partition_grads")
        opt = OffloadZero3Optimizer.__new__(OffloadZero3Optimizer)
        assert opt.partition_grads([1], [2]) == ["theirs"] and calls == [([1], [2])]
    finally:
        ds_compat.copied_source_matches.cache_clear()


def test_the_ranks_settings_reach_the_optimizer_through_its_class(stage3, monkeypatch):
    """DeepSpeed builds the optimizer with its own arguments only: the class install() puts in
    its place carries the rank's settings, each instance has them before DeepSpeed's __init__
    runs (which calls the overrides that read them), and DeepSpeed's arguments pass untouched."""
    from integrations.settings import ZeroEngineSettings
    from integrations.zero3_optimizer import OffloadZero3Optimizer, optimizer_class

    seen = {}
    monkeypatch.setattr(stage3, "__init__", lambda self, *a, **k: seen.update(settings=self.settings, args=a, kw=k))
    settings = ZeroEngineSettings(pins={"prefetch_depth": 1})
    cls = optimizer_class(settings)
    assert issubclass(cls, OffloadZero3Optimizer) and cls.__name__ == "OffloadZero3Optimizer"
    cls("module", init_optimizer="opt")
    assert seen == {"settings": settings, "args": ("module",), "kw": {"init_optimizer": "opt"}}
    assert not hasattr(OffloadZero3Optimizer, "settings")  # nothing left on the class for another rank


@pytest.mark.parametrize("name", sorted(n for _, n in ds_compat.MIRRORED))
def test_a_changed_behaviour_the_integration_relies_on_fails_naming_it(ds, stage3, monkeypatch, name):
    """DeepSpeed 0.19.6-0.19.8 changed four behaviours around the store the
    engine replaces (step's order and its per-subgroup zeroing, what _release_sub_group drops,
    destroy()'s unpinning; offload_states/reload_states' handling of the gradient buffer is what
    the integration steers). A release whose body of one of these differs, with the same
    signature, fails the check with one line naming the method and what is relied on."""

    def changed(self, *args, **kwargs):  # same call, another body
        return None

    changed.__signature__ = inspect.signature(getattr(stage3, name))
    monkeypatch.setattr(stage3, name, changed)
    with pytest.raises(ConfigError) as e:
        ds_compat.check_deepspeed()
    msg = _one_line(e)
    why = ds_compat.MIRRORED[(ds_compat.STAGE3, name)][1]
    assert f"DeepSpeedZeroOptimizer_Stage3.{name} as in {ds_compat.CHECKED_AGAINST} expected ({why}), found another body" in msg
    assert f"pip install 'deepspeed=={ds_compat.CHECKED_AGAINST}'" in msg
