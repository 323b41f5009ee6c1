"""strata/layers/norm_triton.py (RMSNorm and the residual add before it as one Triton kernel;
in triton's interpreter here, see conftest.py) against fused.py's PyTorch functions: plain
and zero-centred weights, rows that do not fill a power of two, strided inputs; whole
engines give the same tokens with it; it compiles for SM86 and SM90 without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_TYPES, build_tiny, compile_kernel, offline_compiled, prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.layers.norm import RMSNorm, ZeroCentredRMSNorm
from strata.sampling.params import SamplingParams

pytest.importorskip("triton")


def rows(tokens: int, hidden: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(tokens, hidden + 5, generator=g))[:, :hidden].to(dtype)  # strided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("kind", [RMSNorm, ZeroCentredRMSNorm])
def test_the_kernel_equals_the_pytorch_norms(dtype, hidden, kind, monkeypatch):
    norm = kind(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(hidden, generator=torch.Generator().manual_seed(9)))
    norm = norm.to(dtype)
    x, residual = rows(7, hidden, dtype, 1), rows(7, hidden, dtype, 2)
    from strata.layers import norm_triton
    called = []
    real = norm_triton.rms_norm
    monkeypatch.setattr(norm_triton, "rms_norm", lambda *a: called.append(1) or real(*a))
    monkeypatch.setattr(RMSNorm, "path", "torch")
    ref_norm, (ref_sum, ref_added) = norm(x), norm.add_and_norm(x, residual)
    monkeypatch.setattr(RMSNorm, "path", "triton")
    ours_norm, (ours_sum, ours_added) = norm(x), norm.add_and_norm(x, residual)
    assert called == [1, 1]
    if dtype == torch.bfloat16:  # NOTE: triton's interpreter truncates float32 to bf16
        torch.testing.assert_close(ours_sum.float(), ref_sum.float(), rtol=8e-3, atol=0)
    else:  # one rounded addition, as PyTorch's
        assert torch.equal(ours_sum, ref_sum)
    for ours, ref in ((ours_norm, ref_norm), (ours_added, ref_added)):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        else:  # rounded where PyTorch rounds: a step apart (the reduction's order); in
            # bf16 up to four, as triton's interpreter truncates where a GPU rounds to nearest
            step = 2e-3 if dtype == torch.float16 else 3.2e-2
            torch.testing.assert_close(ours.float(), ref.float(), rtol=step, atol=step)


def test_it_leaves_what_it_does_not_take_to_pytorch(monkeypatch):
    """Per-head norms (q and k [T, H, D]) and a weight of another dtype than the rows."""
    from strata.layers import norm_triton
    monkeypatch.setattr(norm_triton, "rms_norm", lambda *a: pytest.fail("ran"))
    monkeypatch.setattr(RMSNorm, "path", "triton")
    RMSNorm(16, 1e-6)(torch.randn(3, 2, 16))
    RMSNorm(16, 1e-6)(torch.randn(3, 16, dtype=torch.bfloat16))


def test_engines_give_the_same_tokens_with_it(tmp_path, monkeypatch):
    """A tiny llama (PyTorch attention), drafts: every norm through the kernel
    (prompts too), the residual adds in it."""
    from strata.layers import norm_triton
    folder = tmp_path / "llama"
    model = build_tiny("llama", folder)
    batch = prompts(3, model.config.vocab_size, seed=11, low=5, high=30)
    batch[0] = batch[0][:5] * 4  # repeats: the lookup proposer drafts
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(folder), attention_backend="reference", parallel=3,
                                 max_context=96, max_window_tokens=48))
    monkeypatch.setattr(RMSNorm, "path", "torch")
    ref = engine.generate(batch, params)
    called = []
    real = norm_triton.rms_norm
    monkeypatch.setattr(norm_triton, "rms_norm",
                        lambda *a: called.append(a[3] is not None) or real(*a))
    monkeypatch.setattr(RMSNorm, "path", "triton")
    assert engine.generate(batch, params) == ref
    assert any(called) and not all(called)  # added and plain (the first layer's input)


def _compile(arch: int, dtype, hidden: int, residual: bool) -> int:
    from strata.layers import norm_triton

    def types(name: str) -> str:
        return ("fp32" if name == "eps" else "*" + TRITON_TYPES[dtype] if name.endswith("_ptr")
                else "i32")

    block = 1 << (hidden - 1).bit_length()
    kernel = compile_kernel(norm_triton._rms_norm, arch, dict(
        BLOCK=block, RESIDUAL=residual, ONE_PLUS=residual), types,
        dict(num_warps=min(16, max(1, block // 256)), num_stages=3))
    return kernel.metadata.shared


def test_the_kernel_compiles_for_rtx3090_and_h200(tmp_path):
    code = ("import torch; from test_norm_triton import _compile\n"
            "print(*[_compile(arch, t, h, r) for t in (torch.bfloat16, torch.float16)"
            " for h in (576, 4096) for r in (False, True)])")
    assert len(offline_compiled(code, tmp_path)) == 16
