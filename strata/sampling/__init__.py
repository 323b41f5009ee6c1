"""Per-request sampling parameters and the batched sampler of the last stage."""

from strata.sampling.params import SamplingParams
from strata.sampling.sampler import Sampler

__all__ = ["SamplingParams", "Sampler"]
