"""GGUF checkpoints through the `gguf` package: config, tokenizer and chat template from
the metadata; tensors exposed under Hugging Face names, as their raw blocks and type."""

from __future__ import annotations

import re
from pathlib import Path

from strata.errors import StrataError
from strata.models.config import ModelConfig
from strata.weights.tensor import StoredTensor

# llama.cpp tensor names -> Hugging Face names ({i} is the layer number).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    # qwen3next and qwen35moe: the shared expert and its gate, the Gated DeltaNet's
    # tensors (their values and row order as llama.cpp's converter wrote them:
    # models/qwen3_next.py)
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",    # qwen35moe
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.ssm_a",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


class GGUFCheckpoint:
    format = "gguf"

    def __init__(self, path: Path):
        import gguf

        self.path = path
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package raises many types on bad files
            raise StrataError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                              "it may be truncated or corrupt: download it again") from None
        from strata.tokenizer.gguf_vocab import read_gguf_fields
        self.fields = read_gguf_fields(self._reader)
        self.config = ModelConfig.from_gguf(self.fields)
        self._tensors = {}
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
        self._check_complete()

    def _check_complete(self) -> None:
        size = self.path.stat().st_size
        for t in self._tensors.values():
            if t.data_offset + t.n_bytes > size:
                raise StrataError(f"{self.path} is truncated (tensor {t.name} ends past the end "
                                  "of the file); download it again")

    def has(self, name: str) -> bool:
        return name in self._tensors

    def read(self, name: str) -> StoredTensor:
        if name not in self._tensors:
            raise StrataError(f"{self.path} has no tensor for '{name}'; the file does not match "
                              f"its '{self.config.architecture}' metadata")
        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        return StoredTensor(shape, t.tensor_type.name, t.data)

    def load_tokenizer(self):
        from strata.tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.fields)
