"""One Triton kernel for what an attention layer does to q and k between its projection and
the cache: Qwen3's per-head RMSNorm (when the layer has one) and the rotary embedding
(rotate-half layout, every dim of a head rotating: RotaryEmbedding's common case). On CUDA
this is one launch where PyTorch (or torch.compile) takes two to four: the norms and the
rotations of q and k are separate kernels there, each ~2 us of a CUDA graph's replay,
48 layers a token on a 30B MoE.

Given the cache's key and value tensors and the window's rows (`kv_write`), it also
writes the rotated keys and the values into the cache, which the attention backend's own
write would do in a launch of its own (programs of v's heads after k's copy them).

Program (t, h) takes head h of token t: q's heads first, then k's. It computes in float32
and rounds where the PyTorch functions (strata/layers/fused.py, the ground truth) round in
the activation dtype: the normalised row before the weight, the weight's product, cos and
sin, each product of the rotation and their sum. So bf16 results equal PyTorch's but for
the norm's reduction order and the rare sum that rounds twice.

NOTE: importing this module imports triton; strata/layers/rotary.py imports it only on the
path that runs it. Nothing here syncs with the host or allocates by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import pdl


@triton.jit
def _norm_rotate(q_ptr, k_ptr, q_out, k_out, q_weight, k_weight, cos_ptr, sin_ptr, pos_ptr,
                 v_ptr, key_ptr, value_ptr, slot_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 num_q_heads, num_k_heads, eps,
                 D: tl.constexpr, NORM: tl.constexpr, WRITE: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    dtype = q_out.dtype.element_ty
    i = tl.arange(0, D)
    partner = (i + D // 2) % D  # rotate_half: (-x[D/2:], x[:D/2])
    # Before the wait (pdl.py): the token's position and cache row (the window's metadata,
    # which no kernel writes), the tables' rows and the head's norm weights.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row = tl.load(slot_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + i).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + i).to(dtype).to(tl.float32)
    if h < num_q_heads:
        weight = q_weight
    else:
        weight = k_weight
    if NORM:
        w = tl.load(weight + i).to(tl.float32)
        w_partner = tl.load(weight + partner).to(tl.float32)
    if PDL:  # the next kernel may launch now: it reads nothing of ours before its wait
        pdl.release()
        pdl.wait()
    if WRITE and h >= num_q_heads + num_k_heads:  # a value head: into the cache as it is
        vh = h - num_q_heads - num_k_heads
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + vh * stride_vh + i)
        tl.store(value_ptr + (row * num_k_heads + vh) * D + i, v)
    else:  # a head of q or k, rotated (k's into the cache too)
        sign = tl.where(i < D // 2, -1.0, 1.0)
        if h < num_q_heads:
            src = q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh
            dst = q_out + (t.to(tl.int64) * num_q_heads + h) * D
        else:
            src = k_ptr + t.to(tl.int64) * stride_kt + (h - num_q_heads) * stride_kh
            dst = k_out + (t.to(tl.int64) * num_k_heads + (h - num_q_heads)) * D
        x = tl.load(src + i).to(tl.float32)
        x_partner = tl.load(src + partner).to(tl.float32)
        if NORM:  # rms_norm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), in dtype
            scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            x = (w * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x_partner = (w_partner * (x_partner * scale).to(dtype).to(tl.float32)
                         ).to(dtype).to(tl.float32)
        a = (x * cos).to(dtype).to(tl.float32)
        b = ((sign * x_partner) * sin).to(dtype).to(tl.float32)
        tl.store(dst + i, (a + b).to(dtype))
        if WRITE and h >= num_q_heads:  # a key head: into the cache too
            tl.store(key_ptr + (row * num_k_heads + h - num_q_heads) * D + i,
                     (a + b).to(dtype))


def takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
          weights: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Can the kernel take these: heads of a power-of-two size that the table rotates whole,
    rows contiguous along a head, norm weights (if any) in q's dtype."""
    d = q.shape[-1]
    return (d == k.shape[-1] == cos.shape[-1] and d >= 16 and d & (d - 1) == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype
            and cos.dtype == torch.float32
            and (weights is None or all(w.dtype == q.dtype and w.is_contiguous()
                                        and w.numel() == d for w in weights)))


def writes(k: torch.Tensor, kv_write: tuple) -> bool:
    """Can the kernel write the cache `kv_write` names (v, key, value, rows): v's heads
    contiguous along a head, the cache tensors contiguous [rows, Hkv, D] in k's dtype."""
    v, key, value, _ = kv_write
    return (v.shape == k.shape and v.stride(-1) == 1 and v.dtype == key.dtype == value.dtype
            == k.dtype and key.is_contiguous() and value.is_contiguous()
            and key.shape[1:] == value.shape[1:] == k.shape[1:])


def norm_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor,
                weights: tuple[torch.Tensor, torch.Tensor] | None = None,
                eps: float = 0.0, kv_write: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] -> new contiguous tensors: each head RMSNormed by
    `weights` (q's, k's) when given, then rotated by the tables' rows [positions].
    `kv_write` (v [T, Hkv, D], the cache's key and value [rows, Hkv, D], rows [T]; where
    `writes` allows): the rotated k and v are written to the cache's rows as well."""
    tokens, heads, d = q.shape
    k_heads = k.shape[1]
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)
    if tokens == 0:
        return q_out, k_out
    q_weight, k_weight = weights if weights is not None else (q_out, k_out)  # unused
    v, key, value, rows = kv_write if kv_write is not None else (k, k_out, k_out, positions)
    _norm_rotate[(tokens, heads + k_heads * (2 if kv_write is not None else 1))](
        q, k, q_out, k_out, q_weight, k_weight, cos, sin, positions, v, key, value, rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        heads, k_heads, float(eps),
        D=d, NORM=weights is not None, WRITE=kv_write is not None,
        **pdl.constants(q.device), num_warps=1 if d <= 128 else 2)
    return q_out, k_out
