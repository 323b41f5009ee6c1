"""Stage: a contiguous layer range on one device, with its own KV cache.

Stage 0 also embeds tokens; the last stage also holds the final norm and lm_head and
returns logits for the rows the window asks for. A stage reads only its own tensors
from the checkpoint and decides nothing: its window says where every token goes.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from strata.errors import StrataError
from strata.kvcache.cache import KVCache
from strata.layers.forward_meta import ForwardMeta
from strata.layers.mtp import MTPHead
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, get_architecture


class StageModule(nn.Module):
    """Parameters are named as in Hugging Face checkpoints (`model.layers.7.mlp...`)."""

    def __init__(self, arch: Architecture, start: int, end: int, first: bool, last: bool,
                 mtp: bool = False):
        super().__init__()
        c = arch.config
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling)
        self.model.layers = nn.ModuleDict(
            {str(i): arch.make_layer(i, self.rotary) for i in range(start, end)})
        if last:
            self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if mtp:  # the MTP layer, sharing this stage's embedding (if any) and lm_head
            self.mtp = MTPHead(c.num_layers, arch.make_layer(c.num_layers, self.rotary),
                               vocab=c.vocab_size, hidden=c.hidden_size, eps=c.rms_norm_eps,
                               embed=self.model.embed_tokens if first else None,
                               lm_head=self.lm_head)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, cache: KVCache):
        """x: token ids [T] on the first stage, else hidden [T, hidden].
        Returns hidden [T, hidden]; on the last stage (logits [S, vocab] of the rows the
        window asks for, final-norm hidden [T, hidden] of every row)."""
        h = self.model.embed_tokens(x) if self.first else x
        for i, layer in enumerate(self.model.layers.values()):
            h = layer(h, meta, cache.layer(i))
        if self.last:
            normed = self.model.norm(h)
            return self.lm_head(normed[meta.logits_idx]), normed
        return h


class Stage:
    def __init__(self, index: int, arch: Architecture, layers: tuple[int, int], num_stages: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 num_blocks: int, block_size: int, mtp: bool = False):
        self.index, self.layers, self.device = index, layers, device
        c = arch.config
        last = index == num_stages - 1
        with torch.device("meta"):
            module = StageModule(arch, *layers, first=index == 0, last=last, mtp=mtp and last)
        self.module = module.to_empty(device=device).to(dtype)
        self.module.rotary.reset(device)
        self.cache = KVCache(layers[1] - layers[0], num_blocks, block_size, c.num_kv_heads,
                             c.head_dim, kv_dtype, device)
        self.arch = arch
        self.mtp_cache = (KVCache(1, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                  kv_dtype, device) if hasattr(self.module, "mtp") else None)

    def load(self, checkpoint, progress: tqdm | None = None) -> None:
        """Copy this stage's tensors from the checkpoint, checking every shape."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                if checkpoint.format == "random":
                    checkpoint.fill(name, param)
                else:
                    param.copy_(self._checked(name, param, checkpoint))
                if progress is not None:
                    progress.update(1)

    def _checked(self, name: str, param: torch.Tensor, checkpoint) -> torch.Tensor:
        name = name.removeprefix("mtp.")  # the MTP head's names are the checkpoint's
        tensor = self.arch.load_tensor(name, checkpoint)
        if tuple(tensor.shape) != tuple(param.shape):
            raise StrataError(
                f"{checkpoint.path}: tensor '{name}' has shape {tuple(tensor.shape)} but the "
                f"model config implies {tuple(param.shape)}; the checkpoint does not match "
                "its config")
        return tensor

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        return self.module(x.to(self.device, non_blocking=True), meta, self.cache)


def build_stage(config, model_config, index: int, num_blocks: int, mtp: bool = False) -> Stage:
    """Stage `index` of the layer split in `config`, with empty (unloaded) weights."""
    ranges = config.stage_ranges(model_config.num_layers)
    return Stage(index, get_architecture(model_config), ranges[index], len(ranges),
                 config.stage_device(index), config.torch_dtype(), config.kv_dtype(),
                 num_blocks, config.block_size, mtp=mtp)
