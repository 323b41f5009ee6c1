"""Sampler: one token per row of logits, each row with its own request's parameters.

Greedy rows take the argmax. Other rows apply temperature, top-k, top-p and min-p, then
draw with the exponential-race trick (argmax of p / Exp(1) noise), which lets a seeded
request draw its noise from its own generator. The only host read is the caller's.
"""

from __future__ import annotations

import torch

from strata.sampling.params import SamplingParams


class Sampler:
    def __init__(self):
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               request_ids: list[str]) -> torch.Tensor:
        """logits: [S, V] float -> [S] token ids (on the logits' device)."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        device = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 for p in params):
            logits = _top_k(logits, torch.tensor([p.top_k or logits.shape[1] for p in params],
                                                 device=device))
        if any(p.top_p < 1 for p in params):
            logits = _top_p(logits, torch.tensor([p.top_p for p in params], device=device))
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
        noise = torch.empty_like(probs).exponential_()
        for row, (p, rid) in enumerate(zip(params, request_ids)):
            if p.seed is not None and not p.greedy:
                noise[row].exponential_(generator=self._generator(rid, p.seed, device))
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy, sampled)

    def _generator(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen


def _top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1).clamp(max=logits.shape[1] - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p[:, None])
    drop[:, -1] = False  # always keep the most likely token
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
