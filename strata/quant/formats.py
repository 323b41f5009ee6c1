"""GGUF block formats that Strata keeps quantized on the device: each one's block size (values
per block) and bytes per block. A quantized weight [out, in] is kept as its file stores it,
a uint8 tensor [out, in / block_values * block_bytes]: a GGUF block never spans two rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFormat:
    name: str          # GGUF type name
    block_values: int  # values per block
    block_bytes: int   # bytes per block
    scales: tuple[int, ...] = (0,)  # byte offsets of the block's f16 scale fields

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_values:
            raise ValueError(f"{self.name}: a row of {in_features} values is not a whole "
                             f"number of {self.block_values}-value blocks")
        return in_features // self.block_values * self.block_bytes


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 32, 34),    # d f16, 32 x int8
    BlockFormat("Q4_0", 32, 18),    # d f16, 16 bytes of nibbles; value d * (q - 8)
    BlockFormat("Q4_1", 32, 20, (0, 2)),    # d f16, m f16, 16 bytes of nibbles; d * q + m
    BlockFormat("Q4_K", 256, 144, (0, 2)),  # d, dmin f16, 12 bytes of 6-bit scales and
                                            # mins, 128 of nibbles
    BlockFormat("Q5_K", 256, 176, (0, 2)),  # as Q4_K, plus 32 bytes of fifth bits
    BlockFormat("Q6_K", 256, 210, (208,)),  # 128 low nibbles, 64 of high 2 bits, 16 int8
                                            # scales, d f16
)}
