"""Arrival counters: the device's int32 counters by which a Triton launch's last program
of a group (a row tile's splits, the router's experts) knows it is the last, and then
finishes what the group computed.

Each such program stores its part, counts itself in with an atomic add, and the one that
reads the group's size minus one combines the parts and sets the counter back to 0: the
counters are zero between launches. They are kept for the process's life, since CUDA
graphs hold their address. NOTE: one set per device, shared by every kernel that counts
(the split products of split_sums.py, route_triton), so no two may run at once on one
device: a stage's kernels run one after another on its stream (with PDL, each `wait`s
for the one before), and the expert prefetch's side stream launches none of them.
"""

from __future__ import annotations

import torch

MAX_COUNTERS = 16384  # groups one launch may count (64 KB a device)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's MAX_COUNTERS int32 counters, all zero between launches."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # made inside a capture they would be the graph's memory, zeroed only by it
            raise RuntimeError("a counting kernel's first call was inside a CUDA graph "
                               "capture; run the forward once before capturing it")
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32,
                                                   device=device)
    return counters
