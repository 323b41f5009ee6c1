"""The fused elementwise functions (strata/layers/fused.py) compute exactly what the
unfused steps compute: the residual add in the input dtype then RMSNorm, and the SiLU gate
over the two halves of a stacked gate/up output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strata.layers.decoder import DecoderLayer
from strata.layers.fused import add_rms_norm, rms_norm, silu_mul

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rms_norm_is_add_then_rms_norm(dtype):
    x, residual = (torch.randn(7, 64, generator=GEN).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=GEN)).to(dtype)
    h, normed = add_rms_norm(x, residual, weight, 1e-5)
    assert h.dtype == normed.dtype == dtype
    assert torch.equal(h, x + residual)
    assert torch.equal(normed, rms_norm(x + residual, weight, 1e-5))  # the add rounded first


def test_silu_mul_gates_the_second_half_with_the_first():
    gate, up = torch.randn(5, 64, generator=GEN), torch.randn(5, 64, generator=GEN)
    # NOTE: not bitwise: the CPU's SiLU may round a strided half's tail differently.
    torch.testing.assert_close(silu_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up,
                               rtol=0, atol=1e-6)


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x, meta=None, cache=None):
        return x * self.factor


def test_decoder_layer_is_the_unfused_formula():
    layer = DecoderLayer(64, 1e-5, Scale(-0.7), Scale(1.3)).to(torch.bfloat16)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=GEN)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=GEN)
    x = torch.randn(9, 64, generator=GEN).to(torch.bfloat16)
    h = x + layer.self_attn(layer.input_layernorm(x))
    expected = h + layer.mlp(layer.post_attention_layernorm(h))
    assert torch.equal(layer(x, None, None), expected)
