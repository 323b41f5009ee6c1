"""The weight bytes one decode step reads: the numerator of a decode's bandwidth roofline.

A one-token step reads every weight of its stage but the embedding table (one row) and, in
a MoE layer, only its top-k experts of E: the experts' bytes count k / E times. A weight
kept in its file's blocks counts its block bytes, a dense one its dtype's; one tensor
shared by two modules counts once. The MTP layer (run only while it drafts) is left out,
and so are buffers (rotary tables, caches) and the KV cache, which grows with the context.
"""

from __future__ import annotations

from torch import nn

from strata.layers.moe import GroupedExperts


def top_k(module: nn.Module) -> int | None:
    """The experts a token routes to in a MoE layer (its own `top_k`, or its router's)."""
    k = getattr(module, "top_k", None)
    return k if k is not None else getattr(getattr(module, "gate", None), "top_k", None)


def decode_bytes(stage: nn.Module) -> int:
    """Bytes of the weights a one-token decode step of `stage` reads."""
    seen: set[int] = set()

    def walk(module: nn.Module, share: float) -> float:
        total = 0.0
        for p in module.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += share * p.numel() * p.element_size()
        for name, child in module.named_children():
            if isinstance(child, nn.Embedding) or name == "mtp":
                continue
            part = share
            if isinstance(child, GroupedExperts) and top_k(module) is not None:
                part *= min(1.0, top_k(module) / child.num_experts)
            total += walk(child, part)
        return total

    return round(walk(stage, 1.0))
