"""The proposer registry: `--spec-type` names to proposers built from EngineConfig.
Adding a proposer touches its own file and one line here."""

from __future__ import annotations

from collections.abc import Callable

from strata.config import EngineConfig
from strata.drafting.load_pricing import LoadPricing, from_profile
from strata.drafting.policy import DraftPolicy, SimulatedPolicy
from strata.drafting.pricing import DraftPricing
from strata.drafting.proposer import Proposer
from strata.errors import StrataError
from strata.models.config import ModelConfig


def _suffix(config: EngineConfig) -> Proposer | None:
    from strata.drafting.suffix_tree import SuffixProposer
    if config.spec_suffix_max == 0:
        return None
    # NOTE: depth 16 bounds the tree's memory and the host time of every token it counts
    # (one node per depth where the text repeats: an edit copying a file at 4 streams spent
    # 1.5 ms of an H200 host's time a window at depth 32); a 16-token match drafts as a copy.
    return SuffixProposer(max_draft=config.spec_suffix_max, max_depth=16,
                          global_max_tokens=config.spec_suffix_global,
                          spec_factor=config.spec_suffix_factor)


def _lookup(config: EngineConfig) -> Proposer:
    from strata.drafting.lookup import LookupProposer
    return LookupProposer(min_ngram=config.lookup_min, max_ngram=config.lookup_max,
                          max_draft=config.spec)


def _mtp(config: EngineConfig) -> Proposer:
    from strata.drafting.mtp import MTPProposer
    return MTPProposer()  # the chain's length (--spec) is kept on the last stage


# Each builder returns None where the settings turn its proposer off.
PROPOSERS: dict[str, Callable[[EngineConfig], Proposer | None]] = {
    "suffix": _suffix, "lookup": _lookup, "mtp": _mtp}


def supported(model: ModelConfig) -> list[str]:
    """Proposers this model can use: the CPU proposers always, MTP where the checkpoint
    has MTP layers."""
    return [name for name in PROPOSERS if name != "mtp" or model.num_mtp_layers > 0]


def build_policy(config: EngineConfig, model: ModelConfig) -> DraftPolicy | None:
    if config.spec == 0:
        return None
    if config.simulate_acceptance is not None:
        return SimulatedPolicy(config.spec, config.simulate_acceptance)
    names = list(config.spec_type) or supported(model)
    for name in names:
        if name not in supported(model):
            why = (" (the checkpoint has no MTP layer; for a GGUF model, --mtp-model FILE adds "
                   "one from an MTP GGUF)" if name == "mtp" else "")
            raise StrataError(f"--spec-type {name} is not available for this model{why}; "
                              f"available: {', '.join(supported(model))}")
    proposers = [p for p in (PROPOSERS[name](config) for name in names) if p is not None]
    pricing = DraftPricing() if config.spec_pricing == "measured" else None
    load = load_pricing(config, model) if config.spec_pricing == "load" else None
    return DraftPolicy(proposers, config.spec_token_cost, pricing, load,
                       shared=config.spec_pricing == "shared")


def load_pricing(config: EngineConfig, model: ModelConfig) -> LoadPricing:
    """`--spec-pricing load`: the stage costs of --profile for this split, else fitted
    from each window's stage seconds (stage processes; or the stages in this process,
    which run one after another: one curve, their GPU time on CUDA)."""
    pipelined = config.stage_processes
    if config.profile is not None:
        from strata.calibrate.profile import load_profile
        profile = load_profile(config.profile)
        if profile.num_layers != model.num_layers:
            raise StrataError(f"--profile {config.profile} was measured on a model of "
                              f"{profile.num_layers} layers, this one has {model.num_layers}; "
                              "calibrate this model")
        return from_profile(profile, config)
    return LoadPricing(len(config.layer_split) + 1 if pipelined else 1)
