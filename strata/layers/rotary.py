"""Rotary position embedding (the rotate-half layout of Hugging Face checkpoints).

A cos/sin table is built once per device for every position up to the model's
context; a window looks rows up by its explicit token positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from strata.errors import StrataError


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise StrataError(f"rope scaling type '{kind}' is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        self.theta, self.scaling = theta, scaling
        self.reset()

    def reset(self, device: torch.device | str | None = None) -> None:
        """(Re)build the float32 tables, e.g. after a meta-device module was materialised."""
        inv = _inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D], positions: [T] -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
