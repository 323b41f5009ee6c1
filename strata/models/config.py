"""ModelConfig: one architecture-neutral description of a decoder-only model.

Built from a Hugging Face `config.json` dict or from GGUF metadata. It owns the names
of hyper-parameters inside Strata; model files read only this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import StrataError
from strata.layers.rotary import rope_kind

# GGUF's `general.architecture` values -> Strata architecture names.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe",
                      "qwen35": "qwen3_5"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key: "llama", "qwen3", "qwen3_moe", "glm4_moe",
                       # "deepseek_v3", "qwen3_next", "qwen3_5_moe", "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # heads of the KV cache
    head_dim: int  # dims per head of the KV cache (MLA: max(qk head, v head))
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each q/k head (glm4_moe's use_qk_norm; qwen3 always)
    rotary_dim: int = 0  # leading dims of each head that rotate; 0 = head_dim
    rope_interleave: bool = False  # rotary pairs are (x0, x1), (x2, x3)… not halves
    # Multi-head latent attention (deepseek_v3); kv_lora_rank 0 = not MLA.
    q_lora_rank: int = 0  # 0 = queries straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Mixture of experts (0 experts = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0  # the first k layers are dense
    num_shared_experts: int = 0  # always-on experts, as one MLP of k x moe_intermediate_size
    num_expert_groups: int = 1  # group-limited routing: experts form this many groups…
    topk_expert_groups: int = 1  # …and a token picks its experts from this many of them
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    # Multi-token prediction: decoder layers num_layers … num_layers + num_mtp_layers - 1
    # belong to the MTP module (DeepSeek-V3 / GLM-4.5 layout), not to the main model.
    num_mtp_layers: int = 0
    # Hybrid models (qwen3_next): each layer's token mixer, "full_attention" or
    # "linear_attention" (a Gated DeltaNet: layers/deltanet.py); () = all attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    shared_expert_intermediate_size: int = 0  # one gated shared expert (0 = none)
    eos_token_ids: tuple[int, ...] = field(default=())

    def is_linear_attention(self, layer: int) -> bool:
        return (layer < len(self.layer_types)
                and self.layer_types[layer] == "linear_attention")

    def is_moe_layer(self, layer: int) -> bool:
        if (self.num_experts == 0 or layer in self.mlp_only_layers
                or layer < self.first_k_dense_replace):
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, raw: dict[str, Any], architecture: str) -> ModelConfig:
        """`raw` is a parsed config.json; `architecture` the registry key it resolved to."""
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or None
            if rope and rope.get("rope_type", "default") != "default":
                scaling = dict(rope)
            eos = raw.get("eos_token_id")
            head_dim = int(raw.get("head_dim") or hidden // heads)
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            # transformers' Glm4MoeConfig rotates half of each head unless told otherwise.
            partial = float(rope.get("partial_rotary_factor", raw.get(
                "partial_rotary_factor", 0.5 if architecture == "glm4_moe" else 1.0)))
            rotary_dim = int(head_dim * partial)
            mla = dict(kv_lora_rank=int(raw.get("kv_lora_rank") or 0))
            if mla["kv_lora_rank"]:
                mla.update(q_lora_rank=int(raw.get("q_lora_rank") or 0),
                           qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                           qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                           v_head_dim=int(raw["v_head_dim"]),
                           rope_interleave=bool(raw.get("rope_interleave", True)))
                # The cache holds decompressed per-head keys and values (see layers/mla.py).
                kv_heads = heads
                head_dim = max(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                               mla["v_head_dim"])
                rotary_dim = mla["qk_rope_head_dim"]
            if (rope_kind(scaling) in ("llama3", "yarn")
                    and "original_max_position_embeddings" not in scaling):  # as transformers
                scaling = {**scaling, "original_max_position_embeddings":
                           int(raw.get("max_position_embeddings", 4096))}
            return cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw.get("intermediate_size") or 0),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                qk_norm=bool(raw.get("use_qk_norm", False)),
                rotary_dim=rotary_dim,
                **mla,
                num_experts=int(raw.get("num_experts") or raw.get("num_local_experts")
                                or raw.get("n_routed_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
                num_shared_experts=int(raw.get("n_shared_experts") or 0),
                num_expert_groups=int(raw.get("n_group") or 1),
                topk_expert_groups=int(raw.get("topk_group") or 1),
                routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
                num_mtp_layers=int(raw.get("num_nextn_predict_layers")
                                   or raw.get("num_mtp_layers")
                                   or raw.get("mtp_num_hidden_layers") or 0),
                layer_types=tuple(raw.get("layer_types") or ()),
                linear_num_key_heads=int(raw.get("linear_num_key_heads") or 0),
                linear_num_value_heads=int(raw.get("linear_num_value_heads") or 0),
                linear_key_head_dim=int(raw.get("linear_key_head_dim") or 0),
                linear_value_head_dim=int(raw.get("linear_value_head_dim") or 0),
                linear_conv_kernel=int(raw.get("linear_conv_kernel_dim") or 0),
                shared_expert_intermediate_size=int(
                    raw.get("shared_expert_intermediate_size") or 0),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StrataError(f"config.json is missing or has a bad value for {e}; "
                              "check that the folder holds a complete Hugging Face checkpoint") from None

    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> ModelConfig:
        """`fields` are the GGUF metadata as plain Python values."""
        arch = fields.get("general.architecture", "?")
        if arch not in GGUF_ARCHITECTURES:
            raise StrataError(f"architecture '{arch}' in the GGUF file is not supported; "
                              f"supported in GGUF: {', '.join(GGUF_ARCHITECTURES)} (other "
                              "architectures load from Hugging Face checkpoint folders)")

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise StrataError(f"GGUF metadata lacks '{arch}.{key}'; the file is incomplete, "
                                  "re-convert or re-download it")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
        vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
        eos = fields.get("tokenizer.ggml.eos_token_id")
        # MTP layers (llama.cpp's `nextn`) are the last blocks: block_count counts them.
        mtp_layers = int(fields.get(f"{arch}.nextn_predict_layers") or 0)
        layers = int(get("block_count")) - mtp_layers
        hybrid = {}
        if arch in ("qwen3next", "qwen35moe", "qwen35"):  # DeltaNet layers, then attention
            interval = int(get("full_attention_interval", 4))
            value_heads = int(get("ssm.time_step_rank"))
            hybrid = dict(
                layer_types=tuple("full_attention" if (i + 1) % interval == 0
                                  else "linear_attention" for i in range(layers)),
                linear_num_key_heads=int(get("ssm.group_count")),
                linear_num_value_heads=value_heads,
                linear_key_head_dim=int(get("ssm.state_size")),
                linear_value_head_dim=int(get("ssm.inner_size")) // value_heads,
                linear_conv_kernel=int(get("ssm.conv_kernel")),
                shared_expert_intermediate_size=int(
                    fields.get(f"{arch}.expert_shared_feed_forward_length") or 0),
                rotary_dim=int(fields.get(f"{arch}.rope.dimension_count") or head_dim))
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(fields.get(f"{arch}.feed_forward_length") or 0),
            num_layers=layers,
            num_mtp_layers=mtp_layers,
            num_heads=heads,
            num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position=int(get("context_length", 4096)),
            tie_word_embeddings=False,  # decided by the loader: no output.weight means tied
            num_experts=int(fields.get(f"{arch}.expert_count") or 0),
            num_experts_per_tok=int(fields.get(f"{arch}.expert_used_count") or 0),
            moe_intermediate_size=int(fields.get(f"{arch}.expert_feed_forward_length") or 0),
            # llama.cpp's qwen3moe, qwen3next and qwen35moe renormalise the top-k weights.
            norm_topk_prob=arch in ("qwen3moe", "qwen3next", "qwen35moe"),
            eos_token_ids=() if eos is None else (int(eos),),
            **hybrid,
        )
