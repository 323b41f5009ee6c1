"""Programmatic dependent launch (PDL) of Strata's Triton kernels, on Hopper GPUs and newer.

A decode window runs a chain of small kernels, each reading what the one before wrote.
Launched plainly, a kernel's programs start only once the previous kernel has finished:
the GPU idles between the two (about 0.7 us a boundary on the H200: benchmarks/README.md).
With PDL a kernel is launched while the previous one finishes: its programs start, and
`wait` (griddepcontrol.wait) holds them until the previous kernel has completed and its
writes are visible; each kernel calls `release` (griddepcontrol.launch_dependents) once
its main loop is done, which lets the next launch. A kernel calls them as

    if PDL:
        pdl.wait()

(a constexpr test, not a helper function: triton's interpreter runs a nested jit call
at ~1.5 ms, which in the CPU tests' engines added up to minutes).

Every kernel with a PDL constexpr keeps two rules:
- before its `wait` it neither reads memory that an earlier kernel writes nor writes any
  (Strata's kernels call `wait` first);
- it calls `release` only after its own `wait`, so the next kernel's programs never run
  beside the kernel before this one.
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


def constants(device: torch.device) -> dict:
    """The launch's PDL constexpr, and triton's `launch_pdl` option where it is on."""
    if enabled and supported(device):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)
