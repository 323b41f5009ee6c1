"""How tokens are chosen: per-request sampling parameters, the processed distribution of
a row of logits, and the one Verifier that accepts drafts and samples the next token."""

from strata.sampling.params import SamplingParams
from strata.sampling.verifier import Verifier, VerifyEntry

__all__ = ["SamplingParams", "Verifier", "VerifyEntry"]
