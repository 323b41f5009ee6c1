"""Sampling: the processed distribution of a row of logits under its request's
parameters (logit bias, temperature, top-k, top-p, min-p).

The Verifier draws every token from `processed_probs` (with the exponential-race trick:
argmax of p / Exp(1) noise), with drafts or without, so there is one sampling path.
"""

from __future__ import annotations

import torch

from strata.sampling.params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [R, V] -> [R, V] float32 probabilities, row r processed with params[r].

    Temperature, top-k, top-p and min-p, renormalised.
    A greedy row (temperature 0) is the one-hot of its argmax. Logit biases are applied by
    the caller (`biased_logits`), before this and before any greedy argmax.
    """
    logits = logits.float()
    probs = _truncated_probs(logits, params)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    is_greedy = [p.greedy for p in params]
    if any(is_greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        is_greedy = _to_device(is_greedy, torch.bool, probs.device)
        probs = torch.where(is_greedy[:, None], one_hot, probs)
    return probs


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float logits [R, V] -> softmax after temperature, top-k and top-p, with min-p zeroing
    (rows not renormalised after min-p). Greedy rows are processed at temperature 1."""
    vocab = logits.shape[1]
    rows = _to_device([[p.temperature if not p.greedy else 1.0, min(p.top_k or vocab, vocab),
                        p.top_p, p.min_p] for p in params], torch.float32, logits.device)  # [R, 4]
    logits = logits / rows[:, 0:1]
    if any(p.top_k > 0 for p in params):
        logits = _top_k(logits, rows[:, 1].long())
    if any(p.top_p < 1 for p in params):
        logits = _top_p(logits, rows[:, 2])
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = rows[:, 3]
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0)
    return probs


def biased_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] with each row's `logit_bias` added (a new float tensor), or the logits
    themselves when no row has a bias. Token ids outside the vocabulary raise IndexError."""
    rows, tokens, biases = [], [], []
    for r, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(r)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return logits
    if max(tokens) >= logits.shape[1]:
        raise IndexError(f"logit_bias token id {max(tokens)} is outside the vocabulary "
                         f"({logits.shape[1]} tokens)")
    index = _to_device([rows, tokens], torch.long, logits.device)
    return logits.float().index_put((index[0], index[1]),
                                    _to_device(biases, torch.float32, logits.device),
                                    accumulate=True)


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the stream."""
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


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
