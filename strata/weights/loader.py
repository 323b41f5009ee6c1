"""Per-parameter loading: each parameter of a module built on the meta device is read from
the checkpoint and materialised where and how its ParamSpec says (strata/layers/linear.py).

Checkpoint names are Hugging Face's. The loader maps what every architecture shares (tied
embeddings, stacked experts, projections stacked into one: a spec's `parts`, each read as a
parameter of its own) and asks the architecture for what is its own (the rows of a GGUF
tensor in the order its converter wrote them). Shapes are checked against the model config,
part by part, before anything is copied to the device. A projection whose spec allows it
and whose file stores it in a block format of strata/quant is copied as its blocks (a uint8
tensor with the format's name in `qtype`); everything else is dequantized to its dtype.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from strata.errors import StrataError
from strata.layers.linear import STAGE_DTYPE, ParamSpec, spec_of, with_spec
from strata.models.registry import Architecture
from strata.quant import FORMATS
from strata.weights.experts import is_stacked_expert, stacked_experts
from strata.weights.tensor import StoredTensor


def read_parameter(arch: Architecture, checkpoint, name: str) -> StoredTensor:
    """The stored tensor behind parameter `name` (Hugging Face naming)."""
    if name == "lm_head.weight" and not checkpoint.has(name):
        name = "model.embed_tokens.weight"  # tied embeddings
    if is_stacked_expert(name, checkpoint):
        return stacked_experts(name, checkpoint, arch.config.num_experts)
    if checkpoint.format == "gguf" and (own := arch.read_gguf(checkpoint, name)) is not None:
        return own
    stored = checkpoint.read(name)
    if checkpoint.format == "gguf":
        order = arch.gguf_row_order(name)
        if order is not None:
            stored = stored.take_rows(order)
    return stored


def read_checked(arch: Architecture, checkpoint, name: str, shape: tuple[int, ...],
                 spec: ParamSpec = STAGE_DTYPE) -> StoredTensor:
    """The stored tensor for parameter `name` of `shape`: read, or stacked from the rows of
    the projections its spec names, each read and checked as a parameter of its own."""
    if spec.parts:
        return StoredTensor.cat_rows([
            read_checked(arch, checkpoint, part_name(name, part), (rows, *shape[1:]))
            for part, rows in spec.parts])
    stored = read_parameter(arch, checkpoint, name)
    if tuple(stored.shape) != tuple(shape):
        raise StrataError(
            f"{checkpoint.path}: tensor '{name}' has shape {tuple(stored.shape)} but the model "
            f"config implies {tuple(shape)}; the checkpoint does not match its config")
    return stored


def part_name(name: str, part: str) -> str:
    """`...self_attn.qkv_proj.weight`, `q_proj` -> `...self_attn.q_proj.weight`."""
    owner, _, attr = name.rpartition(".")
    parent = owner.rpartition(".")[0]
    return f"{parent}.{part}.{attr}" if parent else f"{part}.{attr}"


@dataclass
class LoadStats:
    """What a load kept in its file's blocks and what it made dense."""
    quantized: Counter = field(default_factory=Counter)  # format -> tensors kept in it
    quantized_bytes: int = 0
    dense_bytes: int = 0
    host_bytes: int = 0  # placed in host RAM instead (--experts-in-ram)

    def describe(self) -> str:
        formats = ", ".join(f"{n} {t}" for t, n in sorted(self.quantized.items()))
        kept = (f"{sum(self.quantized.values())} weights ({formats}) stay quantized, "
                f"{self.quantized_bytes / 2**20:.1f} MiB" if self.quantized
                else "no weight stays quantized")
        host = f"; {self.host_bytes / 2**20:.1f} MiB in host RAM" if self.host_bytes else ""
        return f"{kept}; {self.dense_bytes / 2**20:.1f} MiB dense{host}"


def load_module(module: nn.Module, checkpoint, arch: Architecture, *, device: torch.device,
                dtype: torch.dtype, checkpoint_name: Callable[[str], str] = lambda n: n,
                progress: tqdm | None = None,
                in_host_ram: Callable[[str], bool] = lambda n: False) -> LoadStats:
    """Materialise every parameter of `module` on `device` (host memory for those that
    `in_host_ram` names): `dtype` unless its spec pins another, or its blocks where the
    spec allows it and the file stores a supported format. `checkpoint_name` maps a
    parameter's name in the module to the checkpoint's."""
    stats = LoadStats()
    for name, param in list(module.named_parameters()):
        place = torch.device("cpu") if in_host_ram(name) else device
        spec = spec_of(param)
        target = spec.dtype or dtype
        qtype = None
        if checkpoint.format == "random":  # drawn on the stage's device (the same values
            # wherever they are kept, and fast), then moved
            value = (checkpoint.blocks(name, tuple(param.shape), device)
                     if spec.quantized else None)
            if value is not None:
                qtype = checkpoint.qtype
            else:
                value = torch.empty(param.shape, dtype=target, device=device)
                checkpoint.fill(name, value)
            value = value.to(place)
        else:
            stored = read_checked(arch, checkpoint, checkpoint_name(name), param.shape, spec)
            if spec.quantized and param.dim() in (2, 3) and stored.type in FORMATS \
                    and not stored.is_torch:  # a projection, or stacked experts
                qtype = stored.type
                value = torch.from_numpy(np.array(stored.data, dtype=np.uint8)).to(place)
            else:
                value = stored.dense(target).to(place)
        loaded = with_spec(nn.Parameter(value, requires_grad=False), spec)
        size = value.numel() * value.element_size()
        if qtype is not None:
            loaded.qtype = qtype  # NOTE: read by Linear.forward
        if in_host_ram(name):
            stats.host_bytes += size
        elif qtype is not None:
            stats.quantized[qtype] += 1
            stats.quantized_bytes += size
        else:
            stats.dense_bytes += size
        _replace(module, name, loaded)
        if progress is not None:
            progress.update(1)
    return stats


def _replace(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, attr, param)
