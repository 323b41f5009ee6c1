"""StoredTensor: one checkpoint tensor as its file stores it.

A GGUF tensor keeps its raw blocks and their type (`Q4_1`, `Q8_0`, `F32`, …) until the
loader decides, per parameter, how it is kept; a safetensors tensor is a torch tensor.
Either way `shape` is the shape the model sees ([out, in] for a projection), and
`dense(dtype)` gives the values. Row selections (llama's rotary un-permutation) and row
concatenations (q, k and v stacked into one projection) work on the raw blocks too, since a
GGUF block never spans two rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# GGUF types whose raw data already is a plain array of values.
_PLAIN = {"F32": torch.float32, "F16": torch.float16}


@dataclass(frozen=True)
class StoredTensor:
    shape: tuple[int, ...]
    type: str                          # GGUF type name, or the torch dtype's ("float32", …)
    data: np.ndarray | torch.Tensor    # raw rows [*shape[:-1], row bytes] or plain values

    @classmethod
    def of(cls, tensor: torch.Tensor) -> StoredTensor:
        return cls(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor)

    @property
    def is_torch(self) -> bool:
        return isinstance(self.data, torch.Tensor)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The values as a `dtype` tensor on the host (dequantized where the file's blocks
        are quantized)."""
        if self.is_torch:
            return self.data.to(dtype)
        if self.type in _PLAIN:
            values = torch.from_numpy(np.array(self.data, copy=True)).view(_PLAIN[self.type])
        else:
            import gguf
            array = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.type])
            values = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        return values.reshape(self.shape).to(dtype)

    def take_rows(self, index: torch.Tensor) -> StoredTensor:
        """Rows `index` of the first dimension, in that order, kept as stored."""
        if self.is_torch:
            return StoredTensor.of(self.data[index])
        return StoredTensor((len(index), *self.shape[1:]), self.type,
                            self.data[index.numpy()])

    @classmethod
    def cat_rows(cls, parts: list[StoredTensor]) -> StoredTensor:
        """The parts' rows one after the other (their other dimensions agree): raw blocks
        stay raw when every part has the same type, else float32 values."""
        if all(p.is_torch for p in parts):
            return cls.of(torch.cat([p.data for p in parts]))
        if len({p.type for p in parts}) == 1 and not any(p.is_torch for p in parts):
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            return cls(shape, parts[0].type, np.concatenate([p.data for p in parts]))
        return cls.of(torch.cat([p.dense(torch.float32) for p in parts]))
