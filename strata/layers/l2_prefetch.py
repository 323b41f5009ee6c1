"""A projection's weight asked into the GPU's L2 cache ahead of its product, while the
latency-bound kernels before it run (Hopper's bulk prefetch, `cp.async.bulk.prefetch.L2`).

A decoding layer's dense projections read their weights from device memory at full
bandwidth, but the kernels between them (the rotation, the attention and the merge of its
splits) wait on latency and leave that bandwidth idle. `prefetch(w)` launches one small
kernel whose threads each ask the SM's bulk-copy unit (TMA) for CHUNK bytes of `w` into L2
and end: no registers, no shared memory, no SM kept busy while the bytes move. The
projection after the latency-bound kernels then reads most of its weight from L2. The
launch is a programmatic dependent one like the layer kernels' (strata/layers/pdl.py): it
releases at its start and waits before it ends, so the chain's order holds; a weight is
never written by a kernel, so reading it before the wait keeps pdl.py's rule. The
prefetch is a hint: the product reads the same bytes with or without it.

Users: Attention asks for o_proj's weight once q, k and v are projected (Linear.prefetch,
windows of up to 64 tokens); moe_triton's gate and up kernel of a 1-2 token window asks,
program by program, for its expert's down weights (`ask`), which the down kernel reads
next. Only on compute capability 9.0 and newer (the bulk-copy unit) and where `enabled`
(`--l2-prefetch`, EngineConfig; off by default: built and tested on the CPU, its speed not
yet measured on a GPU, benchmarks/README.md); elsewhere nothing is asked. Under triton's
interpreter (the CPU tests) there is no such instruction: the tests run the kernels' plans
(`plan`, `share`: which bytes each thread asks for) there, and compile the kernel for SM90
and read the instruction off it.

NOTE: importing this module imports triton. Nothing here syncs with the host or allocates
by data (CUDA graphs).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernel's
# `tl.constexpr` annotations as objects.
import functools

import torch
import triton
import triton.language as tl

from strata.layers import pdl

CHUNK = 16384   # bytes one thread asks for (a multiple of 16, as the instruction needs)
THREADS = 128   # a program's threads (4 warps)
enabled = False  # --l2-prefetch (off until an A/B on a GPU says it helps)


@triton.jit
def ask(pointers, asks, size):
    """Each thread's pointer where `asks`: its `size` bytes (int32, a multiple of 16, the
    pointer 16-byte aligned) asked into L2. Returns zeros (to keep: see _prefetch)."""
    return tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p "
                                     "cp.async.bulk.prefetch.L2.global [$1], $3; "
                                     "mov.b32 $0, 0; }", "=r,l,r,r",
                                     [pointers, asks.to(tl.int32), size],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def plan(program, num_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    """`_prefetch`'s asks of program `program`: thread i's first byte c = (program THREADS
    + i) CHUNK, whether it asks (c inside the weight) and its size in bytes (CHUNK, the
    last one shorter)."""
    start = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64) * CHUNK
    return start, start < num_bytes, tl.minimum(num_bytes - start, CHUNK).to(tl.int32)


@triton.jit
def share(tile, tiles, values, ASKS: tl.constexpr, ASK_VALUES: tl.constexpr):
    """Column tile `tile` of `tiles`'s asks of an expert's `values` 16-bit weights (the MoE
    gate and up kernel's, moe_triton.down_asks): asks tile, tile + tiles, ... of ASK_VALUES
    values each; their first values, whether each asks, and their sizes in bytes."""
    first = (tile + tl.arange(0, ASKS) * tiles).to(tl.int64) * ASK_VALUES
    return first, first < values, (tl.minimum(values - first, ASK_VALUES) * 2).to(tl.int32)


@triton.jit
def _prefetch(w_ptr, num_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr,
              PDL: tl.constexpr):
    """Each thread of a program asks L2 for its CHUNK bytes of w (`plan`), then the
    program waits for the kernel before it."""
    if PDL:  # the next kernel may launch now: it reads nothing of ours
        pdl.release()
    start, asks, size = plan(tl.program_id(0), num_bytes, CHUNK, THREADS)
    done = ask(w_ptr + start, asks, size)
    if PDL:
        pdl.wait()
    # NOTE: never stores (done is 0): it keeps the instruction, whose result is unused
    tl.store(w_ptr + start, done.to(tl.uint8), mask=done != 0)


@functools.cache
def supported(device: torch.device) -> bool:
    """Does `device` have the bulk prefetch? CUDA of compute capability 9.0 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def chunks(num_bytes: int) -> int:
    """Programs of a prefetch of `num_bytes` bytes (THREADS chunks of CHUNK bytes each)."""
    return triton.cdiv(num_bytes, CHUNK * THREADS)


def prefetch(weight: torch.Tensor) -> None:
    """Ask L2 for `weight`'s bytes (contiguous, 16-byte aligned, on a GPU that has the bulk
    prefetch, while `enabled`; else nothing). The instruction takes whole 16-byte units:
    a last few bytes past them are not asked for."""
    if not (enabled and weight.is_cuda and supported(weight.device)
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0):
        return
    data = weight.view(-1).view(torch.uint8)
    num_bytes = data.numel() // 16 * 16
    if num_bytes:
        _prefetch[(chunks(num_bytes),)](data, num_bytes, CHUNK=CHUNK, THREADS=THREADS,
                                        **pdl.constants(weight.device),
                                        num_warps=THREADS // 32)
