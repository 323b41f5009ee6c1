"""Reference (slow but exact) dequantization and matmul for the GGUF block formats in
`strata.quant.formats`.

This module owns the meaning of the bytes: how each format's block of `block_bytes` bytes
turns into `block_values` float values. It is written in plain torch ops, vectorised over
every block of every row, and runs on whatever device the blocks are on. Faster kernels are
checked against it; it is checked against the `gguf` package's numpy dequantizer.

A quantized weight W [out, in] is a uint8 tensor `blocks` of shape [out, row_bytes], exactly
as the GGUF file stores it (row_bytes = in / block_values * block_bytes). The f16 fields are
little-endian; they are read with a dtype view, so this assumes a little-endian host (every
platform torch runs on is).
"""

from __future__ import annotations

import torch

from strata.quant.formats import FORMATS, BlockFormat

__all__ = ["dequantize", "matmul"]


def _f16(field: torch.Tensor) -> torch.Tensor:
    """[..., nb, 2] uint8 -> [..., nb, 1] float32 (a little-endian f16 per block)."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n]: the n low nibbles, then the n high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n] uint8 -> [..., count, n]: field k is (x >> (k * width)) & mask."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8, device=x.device)
    return (x.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    q = b[..., 2:34].view(torch.int8).float()
    return q * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:18]).float() - 8.0
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles(b[..., 4:20]).float()
    return d * q + m


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 6-bit (scale, min) for each of 8 sub-blocks.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise. Sub-blocks
    4-7 take their low 4 bits from bytes 8-11 (scale in the low nibble, min in the high) and
    their top 2 bits from the spare top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_m, packed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 6) << 4)), dim=-1)
    m = torch.cat((lo_m & 0x3F, (packed >> 4) | ((lo_m >> 6) << 4)), dim=-1)
    return sc.float().unsqueeze(-1), m.float().unsqueeze(-1)  # [..., 8, 1] each


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [..., 8, 32]: 32-byte chunk j gives sub-block 2j (low nibbles) and 2j+1
    (high nibbles)."""
    q = _bits(qs.unflatten(-1, (4, 32)), 4, 2)    # [..., 4, 2, 32]
    return q.flatten(-3, -2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
    sc, m = _k_scales(b[..., 4:16])
    q = _k_nibbles(b[..., 16:144]).float()
    return ((d * sc) * q - dmin * m).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
    sc, m = _k_scales(b[..., 4:16])
    high = _bits(b[..., 16:48], 1, 8)             # bit i of qh byte l: sub-block i, value l
    q = (_k_nibbles(b[..., 48:176]) | (high << 4)).float()
    return ((d * sc) * q - dmin * m).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values. Half h: ql[64h : 64h+64] low nibbles are values 0-63, high
    # nibbles 64-127; qh[32h : 32h+32] 2-bit field k of byte l is the top of value 32k + l.
    ql = _bits(b[..., 0:128].unflatten(-1, (2, 64)), 4, 2)    # [..., 2, 2, 64]
    qh = _bits(b[..., 128:192].unflatten(-1, (2, 32)), 2, 4)  # [..., 2, 4, 32]
    q = ql.flatten(-2) | (qh.flatten(-2) << 4)               # [..., 2, 128]
    q = q.flatten(-2).unflatten(-1, (16, 16)).float() - 32.0  # 16 sub-blocks of 16
    sc = b[..., 192:208].view(torch.int8).float().unsqueeze(-1)
    d = _f16(b[..., 208:210]).unsqueeze(-1)
    return ((d * sc) * q).flatten(-2)


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _format(blocks: torch.Tensor, qtype: str) -> BlockFormat:
    fmt = FORMATS.get(qtype)
    if fmt is None or qtype not in _DECODERS:
        raise ValueError(f"unsupported quantization type {qtype!r}; supported: "
                         f"{', '.join(_DECODERS)}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"{qtype}: expected blocks as a 2-D uint8 tensor [out, row_bytes], "
                         f"got {blocks.dtype} of shape {tuple(blocks.shape)}")
    if blocks.shape[1] % fmt.block_bytes:
        raise ValueError(f"{qtype}: row length of {blocks.shape[1]} bytes is not a whole "
                         f"number of {fmt.block_bytes}-byte blocks")
    return fmt


def dequantize(blocks: torch.Tensor, qtype: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a GGUF-quantized weight: `blocks` uint8 [out, row_bytes] -> [out, in] in
    `dtype` (computed in float32, then cast), on `blocks`' device."""
    fmt = _format(blocks, qtype)
    rows, n_blocks = blocks.shape[0], blocks.shape[1] // fmt.block_bytes
    per_block = blocks.reshape(rows, n_blocks, fmt.block_bytes)
    values = _DECODERS[qtype](per_block)                       # [out, n_blocks, block_values]
    return values.reshape(rows, n_blocks * fmt.block_values).to(dtype)


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """y = x @ W^T for x [T, in] (any float dtype) and W given as GGUF `blocks`.

    W is dequantized to float32 and the product is computed in float32 (x upcast); the
    result [T, out] is cast back to x's dtype.
    """
    fmt = _format(blocks, qtype)
    in_features = blocks.shape[1] // fmt.block_bytes * fmt.block_values
    if x.shape[-1] != in_features:
        raise ValueError(f"{qtype}: x has {x.shape[-1]} features but the weight has "
                         f"{in_features}")
    w = dequantize(blocks, qtype, torch.float32)
    return (x.float() @ w.T).to(x.dtype)
