"""A small character-level GPT and generated training text, shared by the examples.

The text comes from a tiny grammar generated at run time, so nothing is downloaded and the
loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn


def generate_text(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    subj = ["the cat", "a dog", "the model", "my optimizer", "the disk", "a gpu", "the tuner"]
    verb = ["reads", "writes", "updates", "prefetches", "caches", "stripes", "trains"]
    obj = ["the state", "a subgroup", "the weights", "every moment", "the gradients", "two paths"]
    adv = ["quickly", "slowly", "in order", "in reverse", "at once", "again"]
    return " ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)} {rng.choice(adv)}." for _ in range(n_sentences))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln(x))


def make_batches(text: str, chars: list[str], ctx: int, batch: int, n: int, seed: int = 0):
    """``n`` (input, target) batches of ``batch`` sequences of ``ctx`` characters, on the CPU
    (a seeded CPU generator makes them the same on every machine); move them to the device."""
    data = torch.tensor([chars.index(c) for c in text])  # cpu ok: moved to the device by the caller
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ix = torch.randint(len(data) - ctx - 1, (batch,), generator=gen)  # cpu ok: indices into CPU data
        out.append((torch.stack([data[i : i + ctx] for i in ix]), torch.stack([data[i + 1 : i + ctx + 1] for i in ix])))
    return out
