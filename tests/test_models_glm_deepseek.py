"""glm4_moe and deepseek_v3 against transformers: tiny random checkpoints built from a
config here give the same logits and the same greedy tokens, split or not, and the MTP
decoder layer (layer num_hidden_layers, which transformers does not build) loads by name
and computes what transformers' decoder layer computes with the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts
from safetensors.torch import save_file
from test_logits import assert_logits_close, reference_greedy

from strata.attention import AttentionBatch, get_backend
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.kvcache.cache import allocate
from strata.kvcache.spec import CacheSize
from strata.layers.forward_meta import ForwardMeta
from strata.layers.rotary import RotaryEmbedding
from strata.models.config import ModelConfig
from strata.models.registry import get_architecture
from strata.sampling.params import SamplingParams
from strata.weights.hf_checkpoint import HFCheckpoint
from strata.weights.loader import load_module

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=512, initializer_range=0.08,
            rms_norm_eps=1e-5, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
            n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.5,
            num_nextn_predict_layers=1, tie_word_embeddings=False)

KINDS = {
    # Partial rotary (half of each head), q/k/v biases, q/k norm, GQA.
    "glm4_moe": dict(num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
                     attention_bias=True, use_qk_norm=True),
    # MLA without a q bottleneck, interleaved rotary, YaRN with both mscales (so cos/sin and
    # the softmax scale are both corrected); V narrower than q/k (V padded in the cache).
    "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        rope_interleave=True, rope_parameters=dict(
                            rope_type="yarn", rope_theta=10000.0, factor=4.0,
                            original_max_position_embeddings=128, mscale=0.7,
                            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)),
    # MLA with a q bottleneck, rotate-half rotary, default rope; V wider than q/k (q and K
    # padded in the cache), attention biases.
    "deepseek_v3_qlora": dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=20,
                              rope_interleave=False, attention_bias=True),
}

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _randomise(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Random values everywhere, including norm weights and the router's selection bias
    (transformers initialises those to ones and zeros, which would hide mistakes)."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            noise = torch.randn(tensor.shape, generator=gen)
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * noise)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * noise)
            elif name.endswith("bias"):
                tensor.copy_(0.1 * noise)
            elif not name.endswith("inv_freq"):
                tensor.copy_(0.08 * noise)


def build(kind: str, folder):
    """Save a tiny transformers model to `folder`, plus its MTP layer (which transformers
    neither builds nor saves) in a second safetensors file; return (model, mtp layer)."""
    import transformers

    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99)
    if kind == "glm4_moe":
        config = transformers.Glm4MoeConfig(**BASE, **KINDS[kind])
        model = transformers.Glm4MoeForCausalLM(config)
    else:
        config = transformers.DeepseekV3Config(**BASE, **KINDS[kind])
        model = transformers.DeepseekV3ForCausalLM(config)
    _randomise(model, gen)
    model.eval()
    model.save_pretrained(folder)
    mtp_index = config.num_hidden_layers
    mtp = type(model.model.layers[-1])(config, mtp_index).eval()
    _randomise(mtp, gen)
    prefix = f"model.layers.{mtp_index}."
    tensors = {prefix + name: t.detach().clone().contiguous()
               for name, t in mtp.state_dict().items()}
    hidden = config.hidden_size  # the MTP module's own tensors, as the real checkpoints have
    tensors.update({prefix + "enorm.weight": torch.ones(hidden),
                    prefix + "hnorm.weight": torch.ones(hidden),
                    prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
                    prefix + "shared_head.norm.weight": torch.ones(hidden)})
    save_file(tensors, str(folder / "model-mtp.safetensors"))  # experts fused, as in memory
    return model, mtp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        out[kind] = (folder, *build(kind, folder))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_and_greedy_match_transformers(tiny, kind):
    folder, model, _ = tiny[kind]
    engine = Engine(EngineConfig(model=str(folder), max_context=256))  # drafts on (default)
    assert engine.runner.stages[0].module.model.layers.keys() == {"0", "1", "2"}
    batch = prompts(3, model.config.vocab_size, seed=7, low=5, high=60)
    for ids in batch:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert_logits_close(engine.score(ids), ref)
    expected = [reference_greedy(model, ids, 16) for ids in batch]
    assert engine.generate(batch, GREEDY) == expected  # together, with drafts
    plain = Engine(EngineConfig(model=str(folder), max_context=256, spec=0))
    assert plain.generate([batch[0]], GREEDY) == expected[:1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_stages_equal_one(tiny, kind):
    folder, model, _ = tiny[kind]
    ids = prompts(1, model.config.vocab_size, seed=3, low=30, high=31)[0]
    results = []
    for split in [(), (2,)]:
        engine = Engine(EngineConfig(model=str(folder), layer_split=split, max_context=128))
        assert len(engine.runner.stages) == len(split) + 1
        results.append((engine.score(ids), engine.generate([ids], GREEDY)[0]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    assert results[1][1] == results[0][1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_mtp_decoder_layer_loads_and_matches(tiny, kind):
    folder, model, mtp = tiny[kind]
    checkpoint = HFCheckpoint(folder)
    c = checkpoint.config
    assert c.num_mtp_layers == 1 and c.num_layers == 3
    arch = get_architecture(c)
    rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling)
    with torch.device("meta"):
        layer = arch.make_layer(c.num_layers, rotary)
    rotary.reset(torch.device("cpu"))  # its variants were made on the meta device too
    load_module(layer, checkpoint, arch, device=torch.device("cpu"), dtype=torch.float32,
                checkpoint_name=lambda name: f"model.layers.{c.num_layers}.{name}")
    assert any("experts" in name for name, _ in layer.named_parameters())  # a MoE layer

    tokens, block = 21, 8
    x = torch.randn(1, tokens, c.hidden_size, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(tokens)
    blocks = (tokens + block - 1) // block
    batch = AttentionBatch([tokens], positions, positions, torch.arange(blocks)[None], block)
    meta = ForwardMeta.build(batch, get_backend("reference"), torch.device("cpu"),
                             logits_idx=torch.tensor([tokens - 1]))
    cache = allocate(arch.cache_spec(c.num_layers), CacheSize(blocks, block, 0), torch.float32,
                     "cpu")
    with torch.no_grad():
        ours = layer(x[0], meta, cache)
        ref = mtp(x, attention_mask=None, position_ids=positions[None],
                  position_embeddings=model.model.rotary_emb(x, positions[None]))[0]
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * ref.abs().max().item())

    with pytest.raises(StrataError, match="does not exist"):
        arch.make_layer(c.num_layers + c.num_mtp_layers, rotary)


def test_config_fields(tiny):
    glm = HFCheckpoint(tiny["glm4_moe"][0]).config
    assert (glm.rotary_dim, glm.head_dim, glm.num_kv_heads, glm.qk_norm) == (16, 32, 2, True)
    assert (glm.num_shared_experts, glm.num_expert_groups, glm.topk_expert_groups) == (1, 4, 2)
    assert not glm.is_moe_layer(0) and glm.is_moe_layer(1) and glm.is_moe_layer(3)
    ds = HFCheckpoint(tiny["deepseek_v3"][0]).config
    # The cache holds per-head K (nope + rope) and V padded to the same width.
    assert (ds.num_kv_heads, ds.head_dim, ds.rotary_dim, ds.q_lora_rank) == (4, 24, 8, 0)
    assert ds.rope_interleave and ds.routed_scaling_factor == 1.5
    assert HFCheckpoint(tiny["deepseek_v3_qlora"][0]).config.head_dim == 20


def test_router_stays_float32_in_bf16(tiny):
    """As in transformers: a bf16 router would flip expert choices."""
    folder = tiny["glm4_moe"][0]
    engine = Engine(EngineConfig(model=str(folder), max_context=64, dtype="bf16", spec=0))
    moe = engine.runner.stages[0].module.model.layers["1"].mlp
    assert moe.experts.gate_proj.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    bias = HFCheckpoint(folder).read("model.layers.1.mlp.gate.e_score_correction_bias").data
    assert torch.equal(moe.gate.e_score_correction_bias, bias)


@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2"])
def test_gguf_is_a_clear_error(arch):
    with pytest.raises(StrataError, match=f"'{arch}' in the GGUF file is not supported"):
        ModelConfig.from_gguf({"general.architecture": arch})
