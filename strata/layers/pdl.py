"""Programmatic dependent launch (PDL) of Strata's Triton kernels, on Hopper GPUs and newer.

A decode window runs a chain of small kernels, each reading what the one before wrote.
Launched plainly, a kernel's programs start only once the previous kernel has finished:
the GPU idles between the two (about 0.7 us a boundary on the H200: benchmarks/README.md).
With PDL a kernel is launched while the previous one finishes: its programs start, and
`wait` (griddepcontrol.wait) holds them until the previous kernel has completed and its
writes are visible; each kernel calls `release` (griddepcontrol.launch_dependents), which
lets the next launch once every program of this one has called it. A kernel calls them as

    if PDL:
        pdl.wait()

(a constexpr test, not a helper function: triton's interpreter runs a nested jit call
at ~1.5 ms, which in the CPU tests' engines added up to minutes).

Every kernel with a PDL constexpr keeps one rule: before its `wait` it neither writes
memory nor reads any that a kernel of the chain writes. What it may read there is a weight
or the window's metadata: the dense projections (gemv_triton.py) load their first step's
weights before they wait, the quantized row GEMV (triton_quant._gemv_rows) reads and
decodes its first step's blocks, the norms load their scales and the MoE router its rows
(route_triton.norm_logits), the rotary kernel (rotary_triton) its tokens' positions, cache
rows, table rows and norm weights, the attention (attention/triton_kernel.py) its tiles,
positions and first block numbers, the L2 prefetch (l2_prefetch.py) the weight it asks
for: the weights stream in while the kernels before them finish, and the metadata, which
the host's copy and PyTorch's kernels write before a chain of PDL kernels starts, is there
by then. A kernel may release at any point, its very start too: the one after it may then
run beside the one before it, which the rule makes harmless, since `wait` returns only
once the previous kernel has completed, and that one completed only after its own `wait`
had returned. The small latency-bound kernels release at their start (the input norm, the
rotary kernel, the attention and the merge of its splits, the MoE's sum of its experts),
and so does a dense row GEMV whose programs all start at once (`one_wave`: the default
model's q/k/v, o and down projections), so that a projection's loads start kernels early;
the others release once their main loop is done (tests/test_pdl.py reads the rule off the
kernels' source; an H100's solo decode of the default model's shape: 1245 -> 1505 tok/s,
benchmarks/README.md).
A kernel that follows without PDL (PyTorch's, cuBLAS's) waits for the whole chain as
usual, and a PDL kernel after one of those starts once it has finished.

PDL needs compute capability 9.0 (the griddepcontrol instructions). Elsewhere (an RTX
3090, CPU tensors under triton's interpreter) `constants` turns the calls off and the
launch is plain. `enabled` switches it off in this process: each stage sets it from
`--pdl` (EngineConfig.pdl), so benchmarks compare both.
"""

from __future__ import annotations

import functools

import torch

try:  # the griddepcontrol instructions, called by the kernels under `if PDL:`
    from triton.language.extra.cuda import gdc_launch_dependents as release
    from triton.language.extra.cuda import gdc_wait as wait
except ImportError:  # a triton older than them: `supported` says no
    wait = release = None

enabled = True


@functools.cache
def supported(device: torch.device) -> bool:
    """Does `device` take PDL launches? CUDA of compute capability 9.0 or more, and a
    triton that has griddepcontrol."""
    return (device.type == "cuda" and wait is not None
            and torch.cuda.get_device_capability(device)[0] >= 9)


ONE_WAVE = 4  # programs an SM holds at once, as `one_wave` counts them


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def one_wave(programs: int, device: torch.device) -> bool:
    """Do `programs` programs all start at once on `device` (ONE_WAVE an SM)? A kernel
    whose programs do may release at its start: the next one's programs then wait beside
    its own, where with more waves they would take the SMs its later programs need."""
    return enabled and supported(device) and programs <= ONE_WAVE * _sm_count(device)


def constants(device: torch.device) -> dict:
    """The launch's PDL constexpr, and triton's `launch_pdl` option where it is on."""
    if enabled and supported(device):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)
