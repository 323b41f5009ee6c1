"""Random-weight checkpoints of real model shapes, for speed studies: speed does not
depend on the values, and a 30B-shaped model is made on the GPU in seconds instead of
being copied there. Named `random:PRESET` or `random:/path/to/config.json`, and
`random:PRESET:QTYPE` (e.g. `random:qwen3-30b-a3b:q4_k`) for one whose projections are
stored in a GGUF block format of strata/quant, as a quantized file's would be (kept so with
`--quantized-weights on`; otherwise the projections are dense like any random model's).

Weights are N(0, 0.02) (norm weights 1), drawn directly on each stage's device from a
seed per parameter name, so every process draws the same model. Quantized projections are
random block bytes whose f16 scale fields are set so that the values spread about as much
(any bytes are a valid block once its scales are finite); a projection whose rows are not
whole blocks stays dense, as a converter falls back to another type, and so do MoE routers,
which llama.cpp's quantize leaves in F32 (ROUTER). Such a model has no
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
from strata.quant.formats import FORMATS

ROUTER = "mlp.gate.weight"  # a MoE layer's router (GGUF: ffn_gate_inp), never quantized

# Per format, the scale fields' values: d, then m or dmin as a multiple of d, chosen so that
# random quants give values of about N(0, 0.02)'s spread, centred near 0.
_SCALES = {"Q8_0": (2.7e-4, None), "Q4_0": (4.3e-3, None), "Q4_1": (4.3e-3, -7.5),
           "Q4_K": (1.0e-4, 7.5), "Q5_K": (5.0e-5, 15.5), "Q6_K": (1.5e-5, None)}


def _qwen3_next(layers: int) -> dict:
    """Qwen3-Next-80B-A3B's config with `layers` layers (a multiple of 4): three Gated
    DeltaNet layers before each gated attention layer, 512 experts top-10 with a gated
    shared expert."""
    return dict(
        architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
        rope_parameters=dict(rope_theta=10000000.0, partial_rotary_factor=0.25),
        rms_norm_eps=1e-6, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False)


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
    # Qwen3-Next-80B-A3B (~160 GB in bf16: more than one H200), and its first 24 layers.
    "qwen3-next-80b-a3b": _qwen3_next(48),
    "qwen3-next-80b-a3b-24l": _qwen3_next(24),
}


class RandomCheckpoint:
    format = "random"

    def __init__(self, spec: str, seed: int = 0):
        self.path = Path(spec)
        self.qtype = None
        preset, _, qtype = spec.rpartition(":")
        if preset in PRESETS:
            if qtype.upper() not in FORMATS:
                raise StrataError(f"random:{spec}: {qtype} is not a block format Strata keeps "
                                  f"quantized ({', '.join(f.lower() for f in FORMATS)})")
            spec, self.qtype = preset, qtype.upper()
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
            param.normal_(0.0, 0.02, generator=self._generator(name, param.device))

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        """Parameter `name`'s random stream. NOTE: crc32, not hash(): the same weights in
        every process (PYTHONHASHSEED)."""
        seed = self.seed + zlib.crc32(name.encode()) % 100_003
        return torch.Generator(device=device).manual_seed(seed)

    def blocks(self, name: str, shape: tuple[int, ...],
               device: torch.device) -> torch.Tensor | None:
        """Random blocks of this checkpoint's format for projection `name` [out, in], or
        stacked experts [E, out, in] (uint8 [..., out, row bytes]); None where it is not
        quantized (no format, rows that are not whole blocks, or a MoE router: llama.cpp's
        quantize never quantizes ffn_gate_inp, so GGUF files keep routers in F32)."""
        fmt = FORMATS.get(self.qtype)
        if (fmt is None or len(shape) not in (2, 3) or shape[-1] % fmt.block_values
                or name.endswith(ROUTER)):
            return None
        n = shape[-1] // fmt.block_values
        raw = torch.randint(0, 256, (*shape[:-1], n, fmt.block_bytes), dtype=torch.uint8,
                            device=device, generator=self._generator(name, device))
        d, second = _SCALES[fmt.name]
        for offset, value in zip(fmt.scales, (d, d * second if second else None)):
            field = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
            raw[..., offset:offset + 2] = field.to(device)
        return raw.reshape(*shape[:-1], n * fmt.block_bytes)

    def read(self, name: str):
        raise StrataError("a random-weight model has no stored tensors")

    def load_tokenizer(self):
        raise StrataError("a random-weight model has no tokenizer; use it with token ids "
                          "(benchmarks), or pass a real --model")
