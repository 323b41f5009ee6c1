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
float32. Where they are read and written is the window's StateMeta (state_meta.py): each
entry starts from its source row (or from zeros where its run starts at position 0), and
the state after each token that may end up the last one committed — the run's last known
token and each of its drafts — is written to that token's row; the scheduler chooses the
row of the verifier's last accepted token. Nothing is copied back and nothing recomputed.

The token loop here is the reference (CPU, fp32, tests): one step per token, as
transformers' `torch_recurrent_gated_delta_rule`. On CUDA the convolution and the delta
rule run as two Triton kernels over the whole window (deltanet_triton.py), reading the
StateMeta on the device: no host sync, so a stage of these layers is captured in CUDA
graphs; the projections and the gated norm are PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kvcache.cache import SlotStateCache
from strata.kvcache.spec import SlotStateSpec
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.layers.state_meta import StateMeta
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
        self.path = "auto"  # "auto", "triton" or "reference" (_triton)

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
        conv_states, states = cache.tensors
        if self._triton(x):
            from strata.layers import deltanet_triton as kernels
            conv = kernels.causal_conv(mixed, self.conv1d.weight, conv_states, meta.state)
            out = kernels.gated_delta_rule(conv, a, b, self.A_log, self.dt_bias, states,
                                           meta.state, self.num_key_heads, self.key_dim)
        else:
            out = self._reference(mixed, a, b, meta.state, conv_states, states)
        o = self.norm(out.to(x.dtype), z)
        return self.out_proj(o.reshape(x.shape[0], -1))

    def _reference(self, mixed, a, b, meta: StateMeta, conv_states, states) -> torch.Tensor:
        """The outputs [T, Hv, Dv] (float32), entry by entry (the rows as host lists)."""
        beta = torch.sigmoid(b.float())                                         # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = torch.zeros(mixed.shape[0], self.num_value_heads, self.value_dim,
                          dtype=torch.float32, device=mixed.device)
        rows = meta.token_row.tolist()
        for first, count, source, fresh in zip(
                *(t.tolist() for t in (meta.entry_start, meta.entry_len, meta.entry_source,
                                       meta.entry_fresh))):
            run = slice(first, first + count)
            if count:
                out[run] = self._run(mixed[run], beta[run], g[run], source, bool(fresh),
                                     rows[run], conv_states, states)
        return out

    def _run(self, mixed, beta, g, source: int, fresh: bool, rows: list[int], conv_states,
             states):
        """One entry's run: its outputs [n, Hv, Dv] (float32); writes the state after
        token i into rows[i] where that is not -1."""
        n = mixed.shape[0]
        kernel = self.conv_kernel
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
        # The convolution's window after token i: inputs[i + 1:i + kernel].
        kept = [i for i in range(n) if rows[i] >= 0]
        after = inputs.unfold(0, kernel - 1, 1)[1:].transpose(1, 2)    # [n, K-1, C]
        conv_states[[rows[i] for i in kept]] = after[kept]
        if n > CHUNK and max(rows[:-1], default=-1) < 0:  # a prompt chunk: one state kept
            out, state = chunked_delta_rule(q, k, v, g, beta, state)
            if rows[-1] >= 0:
                states[rows[-1]] = state
            return out
        out = torch.empty(n, self.num_value_heads, self.value_dim, dtype=torch.float32,
                          device=mixed.device)
        for i in range(n):
            state = state * g[i].exp()[:, None, None]
            remembered = (state * k[i][:, :, None]).sum(dim=1)               # [Hv, Dv]
            delta = (v[i] - remembered) * beta[i][:, None]
            state = state + k[i][:, :, None] * delta[:, None, :]
            out[i] = (state * q[i][:, :, None]).sum(dim=1)
            if rows[i] >= 0:
                states[rows[i]] = state
        return out

    def _triton(self, x: torch.Tensor) -> bool:
        """The convolution and the delta rule as deltanet_triton's kernels: `path`
        "triton", or "auto" on CUDA where triton is installed; else the token loop here
        ("reference")."""
        if self.path == "auto":
            return x.is_cuda and triton_available()
        return self.path == "triton"


CHUNK = 64  # tokens per chunk of chunked_delta_rule (runs of more: prompt chunks)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK):
    """The gated delta rule over a run of n tokens in chunks of `chunk` (the chunked form
    of transformers' torch fallback): within a chunk, the tokens' writes are one
    triangular solve and their reads matrix products; between chunks the state carries.
    q, k [n, H, Dk] (L2-normalised, q scaled), v [n, H, Dv], g and beta [n, H], state [H,
    Dk, Dv], all float32. Returns (outputs [n, H, Dv], the state after the last token);
    equal to the token loop up to float rounding."""
    n, heads = q.shape[:2]
    pad = -n % chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, chunks, chunk, ...]
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))  # zeros: no decay, no write
        return x.view(-1, chunk, *x.shape[1:]).movedim(2, 0)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    decayed = g.cumsum(-1)                                     # [H, N, C]: log decay to i
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (decayed[..., :, None] - decayed[..., None, :]).masked_fill(upper, -torch.inf).exp()
    written = k * beta[..., None]
    # Token i's write depends on the earlier ones' in its chunk: (I - A)^-1 by rows.
    solve = (-(written @ k.transpose(-1, -2)) * decay).masked_fill(~upper.T, 0)  # j < i
    for i in range(1, chunk):
        solve[..., i, :i] = solve[..., i, :i] + (solve[..., i, :i, None]
                                                 * solve[..., :i, :i]).sum(-2)
    solve = solve + torch.eye(chunk, device=q.device)
    values = solve @ (v * beta[..., None])                     # [H, N, C, Dv]
    keys = solve @ (written * decayed.exp()[..., None])        # [H, N, C, Dk]
    out = torch.empty_like(values)
    for c in range(q.shape[1]):
        fresh = values[:, c] - keys[:, c] @ state              # [H, C, Dv]
        within = (q[:, c] @ k[:, c].transpose(-1, -2)) * decay[:, c]
        out[:, c] = (q[:, c] * decayed[:, c].exp()[..., None]) @ state + within @ fresh
        last = decayed[:, c, -1]
        carried = k[:, c] * (last[:, None] - decayed[:, c]).exp()[..., None]
        state = state * last.exp()[:, None, None] + carried.transpose(-1, -2) @ fresh
    return out.flatten(1, 2).transpose(0, 1)[:n], state


def state_spec(num_key_heads: int, num_value_heads: int, key_dim: int, value_dim: int,
               conv_kernel: int) -> SlotStateSpec:
    """A GatedDeltaNet layer's state per row: the convolution's window and the delta
    rule's state, float32."""
    conv_dim = 2 * num_key_heads * key_dim + num_value_heads * value_dim
    return SlotStateSpec(shapes=((conv_kernel - 1, conv_dim),
                                 (num_value_heads, key_dim, value_dim)))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
