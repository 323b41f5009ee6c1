"""Routed experts kept in host RAM with a VRAM cache of them (--experts-in-ram)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertOffload:
    """--experts-in-ram's settings, as a stage takes them."""
    size: tuple[str, float]  # EngineConfig.expert_cache_size()
    policy: str = "lfu"
    pcie_frac: float = 1.0
    prefetch: int = 0  # experts per layer and window uploaded one layer ahead

    @classmethod
    def of(cls, config) -> ExpertOffload | None:
        if config.experts_in_ram != "on":
            return None
        return cls(config.expert_cache_size(), config.expert_cache_policy, config.pcie_frac,
                   config.expert_prefetch)
