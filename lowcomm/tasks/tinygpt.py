"""Small real models for the default workload."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: x += Attn(LN(x)); x += MLP(LN(x)). ``mlp(d)`` builds the MLP
    (default: d → 4d → d with GELU; e.g. a mixture of experts,
    :class:`~lowcomm.parallel.experts.MoE`)."""

    def __init__(self, d: int, heads: int, mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = mlp(d) if mlp is not None else \
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # shapes read from the projections: under tensor (and sequence) parallelism a rank
        # holds heads / T of them (and its x, T-th of the positions)
        h = self.qkv(self.ln1(x))
        q, k, v = h.view(*h.shape[:2], 3, -1, x.shape[-1] // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A byte-level GPT (Radford et al. 2019) small enough for CPU ranks: 256-symbol vocabulary,
    learned positions, tied input/output embedding; ``mlp(d)`` builds each block's MLP (see
    :class:`Block`)."""

    def __init__(self, seq_len: int = 64, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.T

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


MODELS = {"tinygpt": TinyGPT}


def build_model(cfg) -> nn.Module:
    """The model named by ``cfg.model`` for sequences of ``cfg.data.seq_len``."""
    m = cfg.model
    return MODELS[m.name](cfg.data.seq_len, m.d_model, m.n_layers, m.n_heads)
