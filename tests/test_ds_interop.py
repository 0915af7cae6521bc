"""No lock-in: DeepSpeed's documented APIs work with the engine in place, and checkpoints move
between stock DeepSpeed and offloadctl both ways, on real DeepSpeed runs (CPU accelerator, gloo).

Every comparison is against stock DeepSpeed running the same script with the same seed.
"""
from __future__ import annotations

import pytest
import torch
from test_deepspeed_integration import LANE_ON_CPU, _losses, ours, stock

pytestmark = pytest.mark.slow

# Where the state lives in our runs: on NVMe with a 2 kB host cache (the helper's default), all
# of it on NVMe, on the GPU path's tiers (device tier, device lane, NVMe) run on the CPU.
LAYOUTS = {"nvme-and-host": (), "all-nvme": ("--host-cache", "0"), "lane-on-cpu": LANE_ON_CPU}


def _read_values(path: str, ranks: int) -> list[dict]:
    return [torch.load(f"{path}.rank{r}") for r in range(ranks)]


@pytest.mark.parametrize("ranks,dtype,layout", [(1, "fp32", "all-nvme"), (2, "bf16", "nvme-and-host"),
                                                (1, "bf16", "lane-on-cpu")])
def test_partitioned_state_api_matches_stock(ranks, dtype, layout, tmp_path):
    """deepspeed.utils.safe_get_*/safe_set_* and safe_update_full_grad_vectorized ("Debugging"
    and "Modifying Partitioned States" in DeepSpeed's ZeRO-3 docs), with gradient clipping: every
    value read at step 2 equals stock's, and the losses after the writes at step 3 do too. A
    subgroup on NVMe is read from and written to its swap file."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    api = ("--state-api-out",)
    a = stock(ranks, str(tmp_path / "stock.jsonl"), "--dtype", dtype, *api, str(tmp_path / "stock.pt"))
    assert a.returncode == 0, a.stderr[-3000:]
    b = ours(ranks, str(tmp_path / "ours.jsonl"), str(nvme), str(tmp_path / "run"), "--dtype", dtype, *api,
             str(tmp_path / "ours.pt"), opts=LAYOUTS[layout])
    assert b.returncode == 0, b.stderr[-3000:]
    for ref, got in zip(_read_values(str(tmp_path / "stock.pt"), ranks), _read_values(str(tmp_path / "ours.pt"), ranks)):
        assert ref.keys() == got.keys() and len(ref) == 48  # 6 parameters x 8 getters
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "ours.jsonl")), torch.tensor(_losses(tmp_path / "stock.jsonl")),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["all-nvme", "lane-on-cpu"])
def test_module_only_load_of_a_stock_checkpoint_matches_stock(layout, tmp_path):
    """load_checkpoint(load_optimizer_states=False, load_module_only=True), fine-tuning from a
    checkpoint: the masters come from the loaded weights, as in stock. The checkpoint is stock's."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ckpt = str(tmp_path / "ckpt")
    a = stock(1, str(tmp_path / "full.jsonl"), "--save-at", "3", "--ckpt-dir", ckpt)
    assert a.returncode == 0, a.stderr[-3000:]
    only = ("--resume", ckpt, "--resume-module-only")
    ref = stock(1, str(tmp_path / "stock.jsonl"), *only)
    assert ref.returncode == 0, ref.stderr[-3000:]
    b = ours(1, str(tmp_path / "ours.jsonl"), str(nvme), str(tmp_path / "run"), *only, opts=LAYOUTS[layout])
    assert b.returncode == 0, b.stderr[-3000:]
    got, want = _losses(tmp_path / "ours.jsonl"), _losses(tmp_path / "stock.jsonl")
    assert len(got) == len(want) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
