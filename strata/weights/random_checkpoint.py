"""Random-weight checkpoints of real model shapes, for speed studies: speed does not
depend on the values, and a 30B-shaped model is made on the GPU in seconds instead of
being copied there. Named `random:PRESET` or `random:/path/to/config.json`.

Weights are N(0, 0.02) (norm weights 1), drawn directly on each stage's device from a
seed per parameter name, so every process draws the same model. Such a model has no
tokenizer: use it with token ids (benchmarks), never for real text.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from strata.errors import StrataError
from strata.models.config import ModelConfig
from strata.models.registry import resolve_hf_architecture

PRESETS: dict[str, dict] = {
    # SmolLM2-135M-Instruct, the embedded default model.
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen3-30B-A3B.
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False),
}


class RandomCheckpoint:
    format = "random"

    def __init__(self, spec: str, seed: int = 0):
        self.path = Path(spec)
        if spec in PRESETS:
            raw = PRESETS[spec]
        elif Path(spec).is_file():
            raw = json.loads(Path(spec).read_text())
        else:
            raise StrataError(f"random:{spec} is neither a preset ({', '.join(PRESETS)}) nor a "
                              "config.json file")
        self.config = ModelConfig.from_hf(raw, resolve_hf_architecture(raw))
        self.seed = seed

    def has(self, name: str) -> bool:
        return True

    def fill(self, name: str, param: torch.Tensor) -> None:
        """Draw parameter `name` in place on its own device."""
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            # NOTE: crc32, not hash(): the same weights in every process (PYTHONHASHSEED)
            seed = self.seed + zlib.crc32(name.encode()) % 100_003
            gen = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gen)

    def read(self, name: str):
        raise StrataError("a random-weight model has no stored tensors")

    def load_tokenizer(self):
        raise StrataError("a random-weight model has no tokenizer; use it with token ids "
                          "(benchmarks), or pass a real --model")
