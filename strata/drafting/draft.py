"""Draft: what a proposer proposes for one slot and one window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Draft:
    tokens: list[int]             # proposed continuation, at most the asked length
    scores: list[float]           # per token: the proposer's probability that it is right (0..1)
    proposer: str = ""            # name of the proposer that made it
    after_guess: bool = False     # it follows the proposer's guess of a token in flight (the
                                  # guess itself not carried: the window computes that token)
