"""Rotary position embedding (the rotate-half layout of Hugging Face checkpoints).

A cos/sin table is built once per device for every position up to the model's
context; a window looks rows up by its explicit token positions. A table may rotate
only the first dims of each head (partial rotary, MLA's rope dims) and may read its
pairs interleaved (x0, x1), (x2, x3)…: such tables are `variant`s of the stage's one
table, owned by it, so that `reset` rebuilds them all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from strata.errors import StrataError
from strata.layers.fused import rotate, rotate_half
from strata.layers.norm import RMSNorm
from strata.quant import triton_available


def rope_kind(scaling: dict[str, Any] | None) -> str:
    """The scaling's type ("default" without one); old configs call the key `type`."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _inv_freq(head_dim: int, theta: float,
              scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the factor that scales cos and sin."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
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
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise StrataError(f"rope scaling type '{kind}' is not supported "
                      "(supported: default, linear, llama3, yarn)")


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it: interpolate the slow frequencies, keep the fast
    ones, ramp linearly between the dims that turn beta_fast and beta_slow times."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is fast enough to extrapolate
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv, inv_scaled = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return inv_scaled * (1 - keep) + inv * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    # "torch" (fused.py's functions), "triton" (rotary_triton.py: norms and rotation in one
    # kernel) or "auto": triton for CUDA tensors where triton is installed.
    path = "auto"

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, *, interleaved: bool = False):
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position  # head_dim: rotated dims
        self.theta, self.scaling, self.interleaved = theta, scaling, interleaved
        self.variants = nn.ModuleDict()
        self.reset()

    def variant(self, rotary_dim: int, interleaved: bool = False) -> RotaryEmbedding:
        """The table that rotates the first `rotary_dim` dims of a head (pairs interleaved
        or not), with this table's theta and scaling; made once and owned by this module."""
        if rotary_dim == self.head_dim and interleaved == self.interleaved:
            return self
        key = f"{rotary_dim}{'i' if interleaved else ''}"
        if key not in self.variants:
            self.variants[key] = RotaryEmbedding(rotary_dim, self.max_position, self.theta,
                                                 self.scaling, interleaved=interleaved)
        return self.variants[key]

    def reset(self, device: torch.device | str | None = None) -> None:
        """(Re)build the float32 tables, e.g. after a meta-device module was materialised."""
        inv, attention_factor = _inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # yarn: scales q·k through both rotated halves
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        for variant in self.variants.values():
            variant.reset(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D], positions: [T] -> rotated q, k. The first
        head_dim dims of each head rotate; any dims after them pass through."""
        if q.shape[-1] == self.head_dim and not self.interleaved:  # the common case, fused
            return rotate(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def norm_rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                    q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
                    kv_write: tuple | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """q and k each RMSNormed per head by `q_norm` and `k_norm` (Qwen3's, when the
        layer has them), then rotated: one Triton kernel on that path, where the common
        case allows (plain RMSNorm, the table rotating whole heads). `kv_write` (v, the
        cache's key and value, the window's rows: ForwardMeta.kv_write): that kernel also
        writes k and v into the cache where it can; the flag says whether it did."""
        norms = (q_norm, k_norm) if q_norm is not None else None
        if self._triton(q) and not self.interleaved and (
                norms is None or all(type(n) is RMSNorm and n.eps == q_norm.eps for n in norms)):
            from strata.layers import rotary_triton

            weights = None if norms is None else (q_norm.weight, k_norm.weight)
            if rotary_triton.takes(q, k, self.cos, weights):
                write = kv_write is not None and rotary_triton.writes(k, kv_write)
                q, k = rotary_triton.norm_rotate(q, k, self.cos, self.sin, positions, weights,
                                                 q_norm.eps if norms else 0.0,
                                                 kv_write if write else None)
                return q, k, write
        if norms is not None:
            q, k = q_norm(q), k_norm(k)
        return (*self(q, k, positions), False)

    def _triton(self, x: torch.Tensor) -> bool:
        if self.path != "auto":
            return self.path == "triton"
        return x.is_cuda and triton_available()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > self.head_dim:  # partial rotary
            rotated = self._rotate(x[..., :self.head_dim], cos, sin)
            return torch.cat((rotated, x[..., self.head_dim:]), dim=-1)
        if self.interleaved:
            # NOTE: pairs (x0, x1), (x2, x3)… become halves (x0, x2…, x1, x3…), and the
            # result stays in that order, as in transformers: q and k are permuted alike,
            # so q·k is unchanged.
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x * cos + rotate_half(x) * sin
