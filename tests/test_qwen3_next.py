"""Qwen3-Next and Qwen3.5 MoE (hybrid Gated DeltaNet + gated attention + MoE with a gated
shared expert): logits of tiny random checkpoints equal transformers' (prompts over
several prefill chunks too), greedy continuations are identical, and with drafts — accepted and rejected,
1 and several requests at once, one process, windows built ahead, and two stage processes
with pipelined groups — every slot's recurrent state follows exactly its accepted tokens."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY, prompts
from test_logits import GREEDY, assert_logits_close, reference_greedy

from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams


def build_qwen3_next(folder, **overrides):
    """A tiny random Qwen3-Next (3 DeltaNet layers, then full attention, twice) whose
    zero-initialised weights (norms, A_log's spread) are randomised so that they matter."""
    import transformers

    torch.manual_seed(4321)
    config = transformers.Qwen3NextConfig(**{
        **TINY, "num_hidden_layers": 8, "head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 1, "mlp_only_layers": [2], "norm_topk_prob": True,
        **overrides})
    model = transformers.Qwen3NextForCausalLM(config).eval()
    randomise(model)
    model.save_pretrained(folder)
    return model


def build_qwen3_5_moe(folder):
    """A tiny random Qwen3.5 MoE text model: the DeltaNet's projections stored apart, every
    layer's feed-forward routed."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(99)
    config = Qwen3_5MoeTextConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, max_position_embeddings=512)
    model = Qwen3_5MoeForCausalLM(config).eval()
    randomise(model)
    model.save_pretrained(folder)
    return model


def randomise(model) -> None:
    """Weights that initialise to constants (norms, the decay's parameters, the router)
    drawn at random, so that a mistake in them shows."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)      # zero-centred
            elif name.endswith(("dt_bias", "A_log")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "linear_attn.norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    return folder, build_qwen3_next(folder)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    return folder, build_qwen3_5_moe(folder)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_logits_and_greedy_match_transformers(request, kind):
    folder, model = request.getfixturevalue(kind)
    engine = Engine(EngineConfig(model=str(folder), max_context=256, spec=0))
    chunked = Engine(EngineConfig(model=str(folder), max_context=256, spec=0,
                                  max_window_tokens=16))  # prompts over several windows
    for ids in prompts(3, model.config.vocab_size, seed=7, low=5, high=60):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert_logits_close(engine.score(ids), ref)
        assert_logits_close(chunked.score(ids), ref)
        want = reference_greedy(model, ids, 32)
        assert engine.generate([ids], GREEDY)[0] == want
        assert chunked.generate([ids], GREEDY)[0] == want


DRAFT_CASES = {
    "one request": dict(parallel=1),
    "several at once": dict(parallel=4, max_window_tokens=24),
    "windows ahead": dict(parallel=4, schedule_ahead="on", spec_window_cost=0.0),
    "two stage processes, two groups": dict(parallel=4, devices=("cpu", "cpu"),
                                            layer_split=(4,), batch_groups=2),
}


class Oracle:
    """A proposer that knows each prompt's greedy continuation and drafts it with some
    tokens wrong (seeded): windows carry drafts that are accepted, cut short and
    rejected outright, so every way a state rolls back is exercised."""
    name, on_last_stage = "oracle", False

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], seed: int = 0):
        self.expected = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.rng = random.Random(seed)
        self.requests: dict[str, tuple[list[int], list[int]]] = {}

    def start(self, rid, prompt):
        self.requests[rid] = (self.expected[tuple(prompt)], [])

    def extend(self, rid, tokens, stage_drafts=None):
        self.requests[rid][1].extend(tokens)

    def finish(self, rid):
        self.requests.pop(rid, None)

    def propose(self, rid, max_tokens):
        expected, done = self.requests[rid]
        ahead = expected[len(done):len(done) + min(max_tokens, 4)]
        if not ahead:
            return None
        tokens = [t if self.rng.random() > 0.25 else (t + 1) % 320 for t in ahead]
        return Draft(tokens, [0.9 ** (j + 1) for j in range(len(tokens))], self.name)


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_greedy_output_is_the_same_with_drafts(qwen3_next, case):
    folder, model = qwen3_next
    settings = DRAFT_CASES[case]
    count = 1 if settings["parallel"] == 1 else 6
    batch = prompts(count, model.config.vocab_size, seed=3, low=4, high=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(folder), max_context=256, spec=0,
                                parallel=settings["parallel"]))
    want = plain.generate(batch, params)
    engine = Engine(EngineConfig(model=str(folder), max_context=256, spec=4,
                                 spec_token_cost=0.0, **settings))
    engine.scheduler.drafts.proposers = [Oracle(batch, want)]
    try:
        assert engine.generate(batch, params) == want
        stats = engine.draft_stats
        assert stats.accepted > 0 and stats.drafted > stats.accepted, stats
    finally:
        engine.close()


def test_random_weights_of_its_config_run(qwen3_next):
    """`random:config.json` (how the real-shape presets such as `random:qwen3-next-80b-a3b`
    are built) fills every DeltaNet parameter and the model runs."""
    folder, _ = qwen3_next
    engine = Engine(EngineConfig(model=f"random:{folder / 'config.json'}", spec=0,
                                 max_context=64))
    mixer = engine.runner.stages[0].module.model.layers["0"].linear_attn
    assert mixer.conv1d.weight.std() > 0.01 and mixer.A_log.abs().min() > 0
    assert engine.score([1, 2, 3, 4]).isfinite().all()


def test_the_real_shape_preset_reads_as_qwen3_next():
    from strata.weights.random_checkpoint import RandomCheckpoint
    config = RandomCheckpoint("qwen3-next-80b-a3b").config
    assert config.architecture == "qwen3_next" and config.num_layers == 48
    assert [config.is_linear_attention(i) for i in range(4)] == [True, True, True, False]
    assert (config.num_experts, config.num_experts_per_tok, config.rotary_dim) == (512, 10, 64)
