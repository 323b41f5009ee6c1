"""GGUF checkpoints through the `gguf` package: config, tokenizer and chat template from
the metadata; tensors exposed under Hugging Face names, as their raw blocks and type.

MTP layers are llama.cpp's `nextn` blocks, after the model's own (`block_count` counts
them, `nextn_predict_layers` says how many): block N's decoder tensors read as
`mtp.layers.0.*` and its `nextn.eh_proj`, `enorm`, `hnorm` and `shared_head_norm` as
`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and `mtp.norm` (Qwen's
names). Quantized files often leave them out (llama.cpp's converter writes them only when
asked, or into a separate MTP-only GGUF): `mtp` attaches such a file's MTP tensors.
"""

from __future__ import annotations

import re
from dataclasses import replace
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
_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str, num_layers: int | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor; blocks from `num_layers` on are MTP layers."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if not m:
        return None
    block, local = int(m.group(1)), m.group(2)
    mtp = num_layers is not None and block >= num_layers
    if mtp and local in _NEXTN_NAMES:
        return _NEXTN_NAMES[local] if block == num_layers else None  # one MTP layer
    if local in _LAYER_NAMES:
        prefix = f"mtp.layers.{block - num_layers}" if mtp else f"model.layers.{block}"
        return f"{prefix}.{_LAYER_NAMES[local]}"
    return None


class GGUFCheckpoint:
    format = "gguf"

    def __init__(self, path: Path, mtp: Path | None = None):
        """`mtp`: a GGUF holding this model's MTP layer (llama.cpp's MTP-only file)."""
        self.path = path
        self._reader, self.fields = _open(path)
        self.config = ModelConfig.from_gguf(self.fields)
        self._tensors = _tensors(self._reader, path, self.config.num_layers)
        if mtp is not None:
            self._attach_mtp(Path(mtp))

    def _attach_mtp(self, path: Path) -> None:
        if not path.is_file():
            raise StrataError(f"--mtp-model {path}: no such file (give an MTP GGUF: llama.cpp's "
                              "convert_hf_to_gguf.py writes one with --mtp)")
        if self.config.num_mtp_layers:
            raise StrataError(f"--mtp-model {path}: {self.path.name} has its own MTP layer "
                              "already; leave --mtp-model out")
        reader, fields = _open(path)
        config = ModelConfig.from_gguf(fields)
        mine = self.config
        if not config.num_mtp_layers:
            raise StrataError(f"--mtp-model {path} has no MTP layer (no "
                              f"{fields.get('general.architecture')}.nextn_predict_layers)")
        if (config.architecture, config.num_layers, config.hidden_size) != (
                mine.architecture, mine.num_layers, mine.hidden_size):
            raise StrataError(
                f"--mtp-model {path} is an MTP layer for a {config.architecture} of "
                f"{config.num_layers} layers and hidden size {config.hidden_size}, but the "
                f"model is a {mine.architecture} of {mine.num_layers} layers and hidden size "
                f"{mine.hidden_size}: give the MTP file converted from the same model")
        self._mtp_reader = reader  # keeps its memory map open
        self._tensors.update({name: t for name, t in _tensors(reader, path, config.num_layers)
                              .items() if name.startswith("mtp.")})
        self.config = replace(mine, num_mtp_layers=config.num_mtp_layers)

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


def _open(path: Path):
    """The file's reader and its metadata as plain Python values."""
    import gguf

    from strata.tokenizer.gguf_vocab import read_gguf_fields
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises many types on bad files
        raise StrataError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                          "it may be truncated or corrupt: download it again") from None
    return reader, read_gguf_fields(reader)


def _tensors(reader, path: Path, num_layers: int) -> dict:
    """The file's tensors by Hugging Face name, each checked to lie within the file."""
    size = path.stat().st_size
    tensors = {}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise StrataError(f"{path} is truncated (tensor {t.name} ends past the end "
                              "of the file); download it again")
        name = hf_name(t.name, num_layers)
        if name is not None:
            tensors[name] = t
    return tensors
