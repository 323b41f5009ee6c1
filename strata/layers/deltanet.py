"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5, with its
state kept per slot in rows of the layer's SlotStateCache, versioned so that drafts roll
back by choosing a row.

The layer (Hugging Face names): `in_proj_qkvz` and `in_proj_ba` project the input into
query, key, value and output gate z (grouped by key head, as the checkpoint stores them)
and the per-value-head b (write strength, beta = sigmoid(b)) and a (decay input) —
Qwen3.5 stores them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, stacked
here into one `in_proj`, `split_projections`); a
depthwise causal convolution of `conv_kernel` taps (`conv1d`) mixes q, k and v over the
last positions, then SiLU; the gated delta rule updates a [key dim x value dim] state per
value head: S <- S * exp(g); S <- S + k (beta (v - S^T k))^T, with g = -exp(A_log) *
softplus(a + dt_bias), q and k L2-normalised and q scaled by 1/sqrt(key dim); the output
o = S^T q is normalised per head (`norm`, RMSNorm times SiLU(z)) and projected
(`out_proj`).

State (the cache's two tensors per row): the convolution's last `conv_kernel - 1` inputs
[conv_kernel - 1, conv_dim] and the delta rule's S [value heads, key dim, value dim], in
float32. Rows (ForwardMeta.state_rows, one list per entry, chosen by the scheduler):
column 0 holds the state before the entry's run (ignored where the run starts at position
0, ForwardMeta.starts: a fresh sequence); the state after each token that may end up the last one committed
— the run's last known token and each of its drafts (ForwardMeta.num_drafts) — is written
to columns 1, 2, ...: after the verifier accepts j drafts, column 1 + j holds the state
the slot goes on from. Nothing is copied back and nothing recomputed.

The token loop here is the reference (CPU, fp32, tests): one step per token, as
transformers' `torch_recurrent_gated_delta_rule`. On CUDA the same loop runs as one Triton
kernel per run (deltanet_triton.py); the rest of the layer is PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kvcache.cache import SlotStateCache
from strata.kvcache.spec import SlotStateSpec
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.quant import triton_available


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of the gate (in float32, as the
    reference: the weight multiplies the normalised value in the input dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, num_key_heads: int, num_value_heads: int, key_dim: int,
                 value_dim: int, conv_kernel: int, eps: float, linear: LinearFactory,
                 split_projections: bool = False):
        super().__init__()
        if num_value_heads % num_key_heads:
            raise ValueError(f"{num_value_heads} value heads do not group over "
                             f"{num_key_heads} key heads")
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_dim, self.value_dim, self.conv_kernel = key_dim, value_dim, conv_kernel
        keys, values = num_key_heads * key_dim, num_value_heads * value_dim
        self.conv_dim = 2 * keys + values
        self.split_projections = split_projections
        if split_projections:  # one GEMM over the checkpoint's four projections
            self.in_proj = linear.stacked(hidden, {
                "in_proj_qkv": self.conv_dim, "in_proj_z": values,
                "in_proj_b": num_value_heads, "in_proj_a": num_value_heads})
        else:
            self.in_proj_qkvz = linear(hidden, 2 * keys + 2 * values)
            self.in_proj_ba = linear(hidden, 2 * num_value_heads)
        self.conv1d = nn.Module()  # the checkpoint's `conv1d.weight` [conv_dim, 1, kernel]
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = linear(values, hidden)
        self.path = "auto"  # the delta rule: "auto", "triton" or "reference" (_triton)


    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """The projections as the checkpoint groups them (per key head: q, k, then that
        head's value heads' v and z; b then a) -> mixed qkv [T, conv_dim] (q of every
        head, then k, then v), z [T, Hv, Dv], b and a [T, Hv]."""
        tokens = qkvz.shape[0]
        hk, group = self.num_key_heads, self.num_value_heads // self.num_key_heads
        dk, dv = self.key_dim, self.value_dim
        q, k, v, z = qkvz.view(tokens, hk, 2 * dk + 2 * group * dv).split(
            [dk, dk, group * dv, group * dv], dim=-1)
        b, a = ba.view(tokens, hk, 2 * group).split([group, group], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1),
                           v.reshape(tokens, -1)], dim=-1)
        return (mixed, z.reshape(tokens, self.num_value_heads, dv),
                b.reshape(tokens, self.num_value_heads), a.reshape(tokens, self.num_value_heads))

    def _project(self, x: torch.Tensor):
        """mixed qkv [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        if not self.split_projections:
            return self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        heads = self.num_value_heads
        mixed, z, b, a = self.in_proj(x).split(
            [self.conv_dim, heads * self.value_dim, heads, heads], dim=-1)
        return mixed, z.reshape(x.shape[0], heads, self.value_dim), b, a

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: SlotStateCache) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())                                         # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        conv_states, states = cache.tensors
        out = torch.empty(x.shape[0], self.num_value_heads, self.value_dim,
                          dtype=torch.float32, device=x.device)
        offset = 0
        for entry, count in enumerate(meta.query_lens):
            run = slice(offset, offset + count)
            rows = meta.state_rows[entry]
            fresh = meta.starts[entry] == 0  # NOTE: from the host: no sync per entry
            keep = count - 1 - meta.num_drafts[entry]  # first token whose state is kept
            out[run] = self._run(mixed[run], beta[run], g[run], rows, fresh, keep,
                                 conv_states, states)
            offset += count
        o = self.norm(out.to(x.dtype), z)
        return self.out_proj(o.reshape(x.shape[0], -1))

    def _run(self, mixed, beta, g, rows, fresh: bool, keep: int, conv_states, states):
        """One entry's run: its outputs [n, Hv, Dv] (float32); writes the state after
        token i >= keep into rows[1 + i - keep]."""
        n = mixed.shape[0]
        kernel = self.conv_kernel
        source = rows[0]
        if fresh:
            window = mixed.new_zeros(kernel - 1, self.conv_dim, dtype=torch.float32)
            state = mixed.new_zeros(states.shape[1:], dtype=torch.float32)
        else:
            window, state = conv_states[source], states[source]
        inputs = torch.cat([window, mixed.float()])                     # [kernel - 1 + n, C]
        weight = self.conv1d.weight.float().squeeze(1)                  # [C, kernel]
        conv = F.silu((inputs.unfold(0, kernel, 1) * weight).sum(-1))   # [n, C]
        keys = self.num_key_heads * self.key_dim
        q, k, v = conv.split([keys, keys, conv.shape[1] - 2 * keys], dim=-1)
        group = self.num_value_heads // self.num_key_heads
        q = _l2norm(q.view(n, self.num_key_heads, self.key_dim)).repeat_interleave(group, 1)
        k = _l2norm(k.view(n, self.num_key_heads, self.key_dim)).repeat_interleave(group, 1)
        q = q / self.key_dim ** 0.5
        v = v.reshape(n, self.num_value_heads, self.value_dim)
        # The convolution's window after each kept token i: inputs[i + 1:i + kernel].
        after = inputs.unfold(0, kernel - 1, 1)[keep + 1:].transpose(1, 2)  # [kept, K-1, C]
        conv_states[rows[1:1 + n - keep]] = after
        if self._triton(mixed):
            from strata.layers.deltanet_triton import gated_delta_rule
            return gated_delta_rule(q, k, v, g, beta, states, rows, keep, fresh)
        out = torch.empty(n, self.num_value_heads, self.value_dim, dtype=torch.float32,
                          device=mixed.device)
        for i in range(n):
            state = state * g[i].exp()[:, None, None]
            remembered = (state * k[i][:, :, None]).sum(dim=1)               # [Hv, Dv]
            delta = (v[i] - remembered) * beta[i][:, None]
            state = state + k[i][:, :, None] * delta[:, None, :]
            out[i] = (state * q[i][:, :, None]).sum(dim=1)
            if i >= keep:
                states[rows[1 + i - keep]] = state
        return out

    def _triton(self, x: torch.Tensor) -> bool:
        """The delta rule as deltanet_triton's kernel: `path` "triton", or "auto" on CUDA
        where triton is installed; else the token loop here ("reference")."""
        if self.path == "auto":
            return x.is_cuda and triton_available()
        return self.path == "triton"


def state_spec(num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
               conv_kernel: int) -> SlotStateSpec:
    """A GatedDeltaNet layer's state per row: the convolution's window and the delta
    rule's state, float32."""
    conv_dim = 2 * num_key_heads * key_dim + num_value_heads * value_dim
    return SlotStateSpec(shapes=((conv_kernel - 1, conv_dim),
                                 (num_value_heads, key_dim, value_dim)))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
