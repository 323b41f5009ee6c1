"""The fused elementwise functions (strata/layers/fused.py) compute what the unfused steps
compute: the SiLU gate over the two halves of a stacked gate/up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.layers.fused import silu_mul

GEN = torch.Generator().manual_seed(0)


def test_silu_mul_gates_the_second_half_with_the_first():
    gate, up = torch.randn(5, 64, generator=GEN), torch.randn(5, 64, generator=GEN)
    # NOTE: not bitwise: the CPU's SiLU may round a strided half's tail differently.
    torch.testing.assert_close(silu_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up,
                               rtol=0, atol=1e-6)
