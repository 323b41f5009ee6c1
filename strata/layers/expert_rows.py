"""ExpertRows: a MoE layer's output before its last sum, left to the kernel that reads it.

A decode window's fused experts (moe_triton.py) end with each token's k weighted expert
rows in fp32; their sum, cast to the activation dtype, was one more launch (`_combine`)
whose only reader is the next layer's input norm, which adds the residual and norms in a
launch of its own. Handed over as ExpertRows, the norm's kernel (norm_triton.py) makes the
sum itself, in the same order and rounding: one launch fewer a layer, the same bits.
Whoever else reads a layer's output (a stage's last hidden states, a shared expert's add)
calls `summed`, which runs the sum's own kernel.

Importing this module imports neither triton nor the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertRows:
    rows: torch.Tensor   # [T * k, H] float32: token t's k weighted expert rows, t*k ...
    top_k: int
    dtype: torch.dtype   # the activation dtype the sum is cast to

    @property
    def tokens(self) -> int:
        return self.rows.shape[0] // self.top_k

    def summed(self) -> torch.Tensor:
        """[T, H] in `dtype`: each token's rows added in order (fp32), then cast."""
        from strata.layers import moe_triton
        return moe_triton._combined(self.rows, self.tokens, self.top_k, self.dtype)


def summed(x: torch.Tensor | ExpertRows) -> torch.Tensor:
    """`x` as a tensor: ExpertRows summed, a tensor as it is."""
    return x.summed() if isinstance(x, ExpertRows) else x
