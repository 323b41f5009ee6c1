"""Qwen3-Next and Qwen3.5 MoE (hybrid Gated DeltaNet + gated attention + MoE with a gated
shared expert): logits of tiny random checkpoints equal transformers' (prompts over
several prefill chunks too), greedy continuations are identical, and with drafts — accepted and rejected,
1 and several requests at once, one process, windows built ahead, and two stage processes
with pipelined groups — every slot's recurrent state follows exactly its accepted tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, Oracle, prompts
from test_logits import GREEDY, assert_logits_close, reference_greedy

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.layers.deltanet import CHUNK
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
    return saved(transformers.Qwen3NextForCausalLM(config), folder)


QWEN3_5_TINY = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    max_position_embeddings=512)


def build_qwen3_5_moe(folder):
    """A tiny random Qwen3.5 MoE text model: the DeltaNet's projections stored apart, every
    layer's feed-forward routed."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(99)
    config = Qwen3_5MoeTextConfig(**QWEN3_5_TINY, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return saved(Qwen3_5MoeForCausalLM(config), folder)


def build_qwen3_5(folder):
    """A tiny random Qwen3.5 dense text model (the MoE one's layers, a gated MLP)."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(98)
    return saved(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN3_5_TINY, intermediate_size=96)),
                 folder)


def saved(model, folder):
    """`model` in eval mode, randomised and saved to `folder`."""
    model.eval()
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


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    return folder, build_qwen3_5(folder)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_logits_and_greedy_match_transformers(request, kind):
    folder, model = request.getfixturevalue(kind)
    engine = Engine(EngineConfig(model=str(folder), max_context=256, spec=0))
    chunked = Engine(EngineConfig(model=str(folder), max_context=256, spec=0,
                                  max_window_tokens=16))  # prompts over several windows
    batch = prompts(3, model.config.vocab_size, seed=7, low=5, high=150)
    assert max(map(len, batch)) > CHUNK  # a prompt chunk through chunked_delta_rule
    for ids in batch:
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert_logits_close(engine.score(ids), ref)
        assert_logits_close(chunked.score(ids), ref)
        want = reference_greedy(model, ids, 32)
        assert engine.generate([ids], GREEDY)[0] == want
        assert chunked.generate([ids], GREEDY)[0] == want


DRAFT_CASES = {
    "one request": dict(parallel=1),
    "eight at once": dict(parallel=8, max_window_tokens=24),
    "windows ahead": dict(parallel=4, schedule_ahead="on", spec_window_cost=0.0),
    "two stage processes, two groups": dict(parallel=8, devices=("cpu", "cpu"),
                                            layer_split=(4,), batch_groups=2),
    "eight at once, a KV pool that runs short": dict(parallel=8, max_window_tokens=24,
                                                     kv_tokens=256),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_greedy_output_is_the_same_with_drafts(qwen3_next, case):
    folder, model = qwen3_next
    settings = DRAFT_CASES[case]
    count = 1 if settings["parallel"] == 1 else 8
    batch = prompts(count, model.config.vocab_size, seed=3, low=4, high=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(folder), max_context=256, spec=0,
                                parallel=settings["parallel"]))
    want = plain.generate(batch, params)
    engine = Engine(EngineConfig(model=str(folder), max_context=256, spec=4,
                                 spec_token_cost=0.0, **settings))
    ahead = settings.get("schedule_ahead") == "on"
    # windows built ahead: half the requests draft and the others go on in windows ahead,
    # where drafting slots carried on the device draft on a guess of their token (were
    # all requests drafting, no window would be built ahead for such guesses alone)
    drafting = batch[::2] if ahead else batch
    engine.scheduler.drafts.proposers = [Oracle(drafting, want[::2] if ahead else want)]
    headers = []
    submit = engine.runner.submit
    engine.runner.submit = lambda window: (headers.append(window.header), submit(window))
    try:
        assert engine.generate(batch, params) == want
        stats = engine.draft_stats
        assert stats.accepted > 0 and stats.drafted > stats.accepted, stats
        if ahead:
            from test_schedule_ahead import drafts_ahead
            assert all(drafts_ahead([h for h in headers if h.carry]))
    finally:
        engine.close()


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_windows_padded_to_graph_buckets_keep_greedy_output(qwen3_next, path):
    """Stages with DeltaNet layers pad their windows to CUDA-graph buckets (eagerly here,
    as test_buckets.py does): the padding tokens and entries read and write no state row,
    and each window's StateMeta reaches the layers through the buckets' static buffers
    (`triton`: the attention's and the DeltaNet's kernels in triton's interpreter)."""
    from strata.layers.deltanet import GatedDeltaNet
    from test_buckets import padded_everywhere

    folder, model = qwen3_next
    batch = prompts(4, model.config.vocab_size, seed=5, low=4, high=30)
    # NOTE: the interpreted kernels are slow: fewer tokens keep CI in time
    params = SamplingParams(temperature=0, max_tokens=40 if path != "triton" else 16,
                            ignore_eos=True)
    settings = dict(model=str(folder), max_context=256, parallel=4, max_window_tokens=24)
    want = Engine(EngineConfig(**settings, spec=0)).generate(batch, params)
    engine = Engine(EngineConfig(**settings, spec=4, spec_token_cost=0.0,
                                 schedule_ahead="on", spec_window_cost=0.0,
                                 attention_backend="triton" if path == "triton" else "auto"))
    for stage in engine.runner.stages:
        for layer in stage.module.modules():
            if isinstance(layer, GatedDeltaNet):
                layer.path = path
    # half the requests draft: the others go on in windows built ahead, beside drafting
    # slots back from a window sat out
    engine.scheduler.drafts.proposers = [Oracle(batch[::2], want[::2])]
    counts = padded_everywhere(engine, [3, 7, 13, 23])
    headers = []
    submit = engine.runner.submit
    engine.runner.submit = lambda window: (headers.append(window.header), submit(window))
    assert engine.generate(batch, params) == want
    stats = engine.draft_stats
    assert stats.accepted > 0 and stats.drafted > stats.accepted, stats
    assert counts["padded"] > 5 and counts["eager"] > 0, counts
    from test_schedule_ahead import drafts_ahead
    assert drafts_ahead([h for h in headers if h.carry])[0] > 0


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


def tiled(tensor: torch.Tensor, key_heads: int, value_heads: int, dim: int,
          axis: int = 0) -> torch.Tensor:
    """llama.cpp's converter's reorder of value heads (qwen35moe): grouped by key head
    (g * r + j) to tiled (j * key_heads + g), along `axis`."""
    shape = list(tensor.shape)
    parts = shape[:axis] + [key_heads, value_heads // key_heads, dim] + shape[axis + 1:]
    return tensor.reshape(parts).transpose(axis, axis + 1).reshape(shape)


def write_qwen3next_gguf(model, path, arch: str = "qwen3next", mtp: dict | None = None,
                         body: bool = True) -> None:
    """`model` (transformers Qwen3-Next, or Qwen3.5 MoE for `qwen35moe`) written as
    llama.cpp's converter writes it (convert_hf_to_gguf.py, Qwen3NextModel and, for
    Qwen3.5, _LinearAttentionVReorderBase): norms plus 1 but the DeltaNet's, A_log as
    -exp(A_log), conv1d squeezed, dt_bias as ssm_dt.bias, in_proj_qkvz split into
    attn_qkv (q of every head, then k, then v) and attn_gate (z), experts stacked; for
    qwen35moe every tensor indexed by value head with the heads tiled.
    `mtp` (Qwen's `mtp.*` tensors): its layer as block N (`nextn_predict_layers` 1), as
    llama.cpp's converter writes it when asked; without `body`, only that layer (an
    MTP-only file)."""
    import gguf
    import numpy as np

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers + (1 if mtp else 0))
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(getattr(c, "intermediate_size", None) or c.moe_intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    if getattr(c, "num_experts", 0):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    hk, dk, hv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads
    dv, keys = c.linear_value_head_dim, 2 * c.linear_num_key_heads * c.linear_key_head_dim
    w.add_vocab_size(c.vocab_size)
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
             "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
             "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight",
             "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
             "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
             "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
             "linear_attn.out_proj.weight": "ssm_out.weight",
             "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
             "linear_attn.in_proj_z.weight": "attn_gate.weight",
             "linear_attn.in_proj_b.weight": "ssm_beta.weight",
             "linear_attn.in_proj_a.weight": "ssm_alpha.weight"}
    per_head_v = hv // hk * dv
    qwen35 = arch in ("qwen35moe", "qwen35")

    def add(name, tensor):
        w.add_tensor(name, np.ascontiguousarray(tensor.detach().float().numpy()))

    def layer(state: dict, prefix: str, i: int) -> None:
        if f"{prefix}mlp.experts.down_proj" in state:  # [E, 2I, H]: gate rows, then up
            gate_up = state[f"{prefix}mlp.experts.gate_up_proj"]
            if qwen35:  # fused, as qwen35moe files keep them
                add(f"blk.{i}.ffn_gate_up_exps.weight", gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=1)
                add(f"blk.{i}.ffn_gate_exps.weight", gate)
                add(f"blk.{i}.ffn_up_exps.weight", up)
            add(f"blk.{i}.ffn_down_exps.weight", state[f"{prefix}mlp.experts.down_proj"])
        elif f"{prefix}mlp.experts.0.gate_proj.weight" in state:  # one by one (files)
            for proj, ours in (("gate", "gate_exps"), ("up", "up_exps"), ("down", "down_exps")):
                add(f"blk.{i}.ffn_{ours}.weight", torch.stack([
                    state[f"{prefix}mlp.experts.{e}.{proj}_proj.weight"]
                    for e in range(c.num_experts)]))
        for key, tensor in state.items():
            if not key.startswith(prefix) or ".experts." in key:
                continue
            local = key[len(prefix):]
            if local == "linear_attn.in_proj_qkvz.weight":
                q, k, v, z = tensor.view(hk, 2 * dk + 2 * per_head_v, -1).split(
                    [dk, dk, per_head_v, per_head_v], dim=1)
                flat = [part.reshape(-1, tensor.shape[1]) for part in (q, k, v, z)]
                add(f"blk.{i}.attn_qkv.weight", torch.cat(flat[:3]))
                add(f"blk.{i}.attn_gate.weight", flat[3])
                continue
            if qwen35 and local.startswith("linear_attn."):  # value heads tiled
                if local in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
                    tensor = torch.cat([tensor[:keys], tiled(tensor[keys:], hk, hv, dv)])
                elif local == "linear_attn.in_proj_z.weight":
                    tensor = tiled(tensor, hk, hv, dv)
                elif local in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                               "linear_attn.A_log", "linear_attn.dt_bias"):
                    tensor = tiled(tensor, hk, hv, 1)
                elif local == "linear_attn.out_proj.weight":
                    tensor = tiled(tensor, hk, hv, dv, axis=1)
            if local.endswith("norm.weight") and not local.startswith("linear_attn"):
                tensor = tensor + 1
            elif local == "linear_attn.A_log":
                tensor = -torch.exp(tensor)
            elif local == "linear_attn.conv1d.weight":
                tensor = tensor.squeeze(1)
            add(f"blk.{i}.{names[local]}", tensor)

    if body:
        state = model.state_dict()
        add("token_embd.weight", state["model.embed_tokens.weight"])
        add("output.weight", state["lm_head.weight"])
        add("output_norm.weight", state["model.norm.weight"] + 1)
        for i in range(c.num_hidden_layers):
            layer(state, f"model.layers.{i}.", i)
    if mtp:
        n = c.num_hidden_layers
        layer(mtp, "mtp.layers.0.", n)
        add(f"blk.{n}.nextn.eh_proj.weight", mtp["mtp.fc.weight"])
        for ours, theirs in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                             ("shared_head_norm", "norm")):
            add(f"blk.{n}.nextn.{ours}.weight", mtp[f"mtp.{theirs}.weight"] + 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe", "qwen35"])
def test_a_gguf_in_llama_cpps_layout_gives_the_same_logits(tmp_path, arch):
    if arch == "qwen3next":
        model = build_qwen3_next(tmp_path, mlp_only_layers=[])  # llama.cpp: every layer MoE
    elif arch == "qwen35moe":
        model = build_qwen3_5_moe(tmp_path)
    else:
        model = build_qwen3_5(tmp_path)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_qwen3next_gguf(model, path, arch)
    engine = Engine(EngineConfig(model=str(path), max_context=256, spec=0))
    config = engine.model_config
    assert config.architecture == {"qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe",
                                   "qwen35": "qwen3_5"}[arch]
    assert config.rotary_dim == 4
    assert config.layer_types == tuple(model.config.layer_types)
    for ids in prompts(2, model.config.vocab_size, seed=8, low=5, high=40):
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        assert_logits_close(engine.score(ids), ref)


@pytest.mark.parametrize("case", ["eight at once", "two stage processes, two groups"])
def test_suffix_and_lookup_drafts_keep_greedy_output(qwen3_next, case):
    """The CPU proposers' own drafts (prompts that repeat themselves, so they draft), 8
    requests at once with prompt chunks and decoding in the same windows."""
    folder, model = qwen3_next
    settings = dict(parallel=8, max_window_tokens=32)
    if case.startswith("two"):
        settings.update(devices=("cpu", "cpu"), layer_split=(4,), batch_groups=2)
    batch = [ids * 4 for ids in prompts(8, model.config.vocab_size, seed=21, low=3, high=9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(folder), max_context=256, spec=0, parallel=8))
    want = plain.generate(batch, params)
    engine = Engine(EngineConfig(model=str(folder), max_context=256, spec=4,
                                 spec_type=("suffix", "lookup"), spec_token_cost=0.0,
                                 **settings))
    try:
        assert engine.generate(batch, params) == want
        assert engine.draft_stats.drafted > 0
    finally:
        engine.close()


def add_mtp_layer(folder) -> dict:
    """Give the checkpoint in `folder` an MTP layer (`mtp.*`, as Qwen's files carry it:
    transformers does not model it): fc, the two pre-fc norms, one full-attention decoder
    layer (a copy of layer 3's, perturbed), a final norm. Returns its tensors."""
    from safetensors.torch import load_file, save_file

    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(17)
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.3."):
            mtp["mtp.layers.0." + name.removeprefix("model.layers.3.")] = (
                t + 0.05 * torch.randn(t.shape, generator=g)).contiguous()
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g) * 0.2
    save_file({**tensors, **mtp}, weights, metadata={"format": "pt"})
    return mtp


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory, qwen3_next):
    """The tiny Qwen3-Next with an MTP layer in its checkpoint (add_mtp_layer)."""
    import json
    import shutil

    source, _ = qwen3_next
    folder = tmp_path_factory.mktemp("qwen3_next_mtp")
    for f in source.iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    add_mtp_layer(folder)
    return folder


MTP_CASES = {
    "one request": dict(parallel=1),
    "eight at once": dict(parallel=8, max_window_tokens=24),
    "two stage processes, two groups": dict(parallel=8, devices=("cpu", "cpu"),
                                            layer_split=(4,), batch_groups=2),
    "eight at once, a KV pool that runs short": dict(parallel=8, max_window_tokens=24,
                                                     kv_tokens=256),
}


@pytest.mark.parametrize("case", list(MTP_CASES))
def test_mtp_drafts_keep_greedy_output(qwen3_next_mtp, case):
    settings = MTP_CASES[case]
    batch = prompts(1 if settings["parallel"] == 1 else 8, 320, seed=12, low=4, high=30)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(qwen3_next_mtp), max_context=256, spec=0,
                                parallel=settings["parallel"]))
    want = plain.generate(batch, params)
    engine = Engine(EngineConfig(model=str(qwen3_next_mtp), max_context=256, spec=3,
                                 spec_type=("mtp",), spec_min_p=0.0, spec_token_cost=0.0,
                                 **settings))  # a random MTP layer's drafts: all sent
    try:
        assert engine.scheduler.drafts.on_last_stage  # the MTP layer drafts
        assert engine.generate(batch, params) == want
        stats = engine.draft_stats
        assert stats.drafted > stats.accepted, stats  # rejected drafts rolled back
        if "kv_tokens" in settings:  # states and MTP drafts start over after preemption
            assert engine.scheduler.preemptions > 0
    finally:
        engine.close()


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])  # the last: 2 processes
def test_prefix_reuse_with_mtp_drafts_keeps_the_drafts(qwen3_next_mtp, devices):
    """An agent's second turn reuses the first's blocks and a state snapshot taken one
    token before their end: that token runs again (for the MTP layer's hidden state) from
    the state before it. The output and every drafted and accepted count are those of
    computing it all."""
    first = prompts(1, 320, seed=13, low=30, high=31)[0]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run(prefix_cache: str):
        engine = Engine(EngineConfig(model=str(qwen3_next_mtp), max_context=256, spec=3,
                                     spec_type=("mtp",), spec_min_p=0.0, spec_token_cost=0.0,
                                     parallel=1, block_size=4, prefix_cache=prefix_cache,
                                     layer_split=(2,) if len(devices) > 1 else (),
                                     devices=devices, stage_threads=1))
        try:
            answer = engine.generate([first], params)[0]
            second = engine.add_request(first + answer + [7, 8, 9], params)
            while engine.has_work:
                engine.step()
        finally:
            engine.close()
        stats = second.draft_stats
        return answer, second.output_ids, (stats.drafted, stats.accepted), \
            second.num_cached_tokens

    on, off = run("on"), run("off")
    assert on[:3] == off[:3] and on[2][0] > on[2][1] > 0
    assert on[3] >= 55 and off[3] == 0  # 14 blocks of the first turn, less the token run again


def test_an_mtp_layer_reads_from_nextn_blocks_or_a_separate_mtp_gguf(tmp_path, caplog):
    """llama.cpp's layout of the MTP layer (block N of `nextn_predict_layers`, with its
    `nextn.*` tensors), in the model's GGUF or in an MTP-only GGUF beside one without it
    (--mtp-model), drafts exactly as the Hugging Face folder's `mtp.*` do; a GGUF without
    it says so at start-up, and wrong files get a clear error."""
    import logging

    from strata.errors import StrataError

    folder = tmp_path / "hf"
    model = build_qwen3_next(folder, mlp_only_layers=[])  # llama.cpp: every layer MoE
    mtp = add_mtp_layer(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    paths = {name: tmp_path / f"{name}.gguf" for name in ("with", "without", "mtp")}
    write_qwen3next_gguf(model, paths["with"], mtp=mtp)
    write_qwen3next_gguf(model, paths["without"])
    write_qwen3next_gguf(model, paths["mtp"], mtp=mtp, body=False)
    batch = prompts(2, model.config.vocab_size, seed=12, low=4, high=30)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    drafting = dict(max_context=256, spec=3, spec_type=("mtp",), spec_min_p=0.0,
                    spec_token_cost=0.0)
    runs = {}
    for name, files in {"folder": dict(model=str(folder)),
                        "one gguf": dict(model=str(paths["with"])),
                        "two ggufs": dict(model=str(paths["without"]),
                                          mtp_model=str(paths["mtp"]))}.items():
        engine = Engine(EngineConfig(**files, **drafting))
        assert engine.model_config.num_mtp_layers == 1
        tokens = engine.generate(batch, params)
        runs[name] = (tokens, engine.draft_stats.drafted, engine.draft_stats.accepted)
    assert runs["one gguf"] == runs["folder"] == runs["two ggufs"]
    assert runs["folder"][1] > runs["folder"][2] > 0

    with caplog.at_level(logging.INFO, logger="strata.engine"):
        Engine(EngineConfig(model=str(paths["without"]), max_context=256, spec=3))
    assert "has no MTP layer" in caplog.text and "--mtp-model" in caplog.text
    bad = {"no MTP layer.*--mtp-model FILE adds": dict(model=paths["without"], **drafting),
           "has its own MTP layer": dict(model=paths["with"], mtp_model=paths["mtp"]),
           "has no MTP layer \\(no qwen3next.nextn_predict_layers\\)":
               dict(model=paths["without"], mtp_model=paths["without"]),
           "no such file": dict(model=paths["without"], mtp_model=tmp_path / "nothing.gguf"),
           "a Hugging Face folder or a random: model carries its own":
               dict(model=folder, mtp_model=paths["mtp"])}
    for message, settings in bad.items():
        with pytest.raises(StrataError, match=message):
            Engine(EngineConfig(**{k: str(v) if k != "spec_type" and isinstance(v, Path) else v
                                   for k, v in settings.items()}))
