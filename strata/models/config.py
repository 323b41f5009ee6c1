"""ModelConfig: one architecture-neutral description of a decoder-only model.

Built from a Hugging Face `config.json` dict or from GGUF metadata. It owns the names
of hyper-parameters inside Strata; model files read only this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import StrataError

# GGUF's `general.architecture` values -> Strata architecture names.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key: "llama", "qwen3", "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Mixture of experts (0 experts = dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default=())

    def is_moe_layer(self, layer: int) -> bool:
        if self.num_experts == 0 or layer in self.mlp_only_layers:
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
            return cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw.get("intermediate_size") or 0),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
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
            from strata.models.registry import supported_architectures
            raise StrataError(f"architecture '{arch}' in the GGUF file is not supported; "
                              f"supported: {', '.join(supported_architectures())}")

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
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(fields.get(f"{arch}.feed_forward_length") or 0),
            num_layers=int(get("block_count")),
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
            # llama.cpp's qwen3moe always renormalises the top-k weights.
            norm_topk_prob=arch == "qwen3moe",
            eos_token_ids=() if eos is None else (int(eos),),
        )
