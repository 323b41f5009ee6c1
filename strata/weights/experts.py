"""Expert weights of mixture-of-experts checkpoints.

Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj.weight`) or fused
(`mlp.experts.gate_up_proj` [E, 2I, hidden]); Strata keeps them stacked per projection
(`mlp.experts.gate_proj` [E, I, hidden]), which is also GGUF's layout.
"""

from __future__ import annotations

import torch

from strata.weights.tensor import StoredTensor

STACKED = (".mlp.experts.gate_proj", ".mlp.experts.up_proj", ".mlp.experts.down_proj")


def is_stacked_expert(name: str, checkpoint) -> bool:
    """A stacked expert parameter that the checkpoint does not hold as such."""
    return name.endswith(STACKED) and not checkpoint.has(name)


def stacked_experts(name: str, checkpoint, num_experts: int) -> StoredTensor:
    """`...mlp.experts.{gate,up,down}_proj` [E, out, in] from per-expert or fused tensors."""
    prefix, proj = name.rsplit(".", 1)  # "model.layers.N.mlp.experts", "gate_proj"

    def read(tensor_name: str) -> torch.Tensor:
        stored = checkpoint.read(tensor_name)
        return stored.data if stored.is_torch else stored.dense(torch.float32)

    if checkpoint.has(f"{prefix}.gate_up_proj"):
        if proj == "down_proj":
            return checkpoint.read(f"{prefix}.down_proj")
        gate, up = read(f"{prefix}.gate_up_proj").chunk(2, dim=1)
        return StoredTensor.of(gate if proj == "gate_proj" else up)
    return StoredTensor.of(torch.stack([read(f"{prefix}.{e}.{proj}.weight")
                                        for e in range(num_experts)]))
