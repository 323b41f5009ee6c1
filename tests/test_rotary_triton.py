"""strata/layers/rotary_triton.py (Qwen3's per-head norms and the rotation of q and k in one
kernel; in triton's interpreter here, see conftest.py) against the PyTorch functions it
replaces, on strided q and k as the layer hands them over (views of one qkv projection);
whole engines give the same tokens on either path; the backend's one-launch KV write
equals two index copies, and the rotation's own write of the cache equals it; both kernels
compile for SM86 and SM90 without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_TYPES, build_tiny, compile_kernel, offline_compiled, prompts

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.layers.norm import RMSNorm
from strata.layers.rotary import RotaryEmbedding
from strata.sampling.params import SamplingParams

pytest.importorskip("triton")


def qkv_views(tokens: int, heads: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    """q [T, H, D], k and v [T, Hkv, D]: views of one [T, (H + 2 Hkv) D] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    return (q.reshape(tokens, heads, dim), k.view(tokens, kv_heads, dim),
            v.view(tokens, kv_heads, dim))


def norms(dim: int, dtype, seed: int = 3) -> tuple[RMSNorm, RMSNorm]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        norm = RMSNorm(dim, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=g))
        out.append(norm)
    return tuple(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("with_norm", [False, True])
def test_one_kernel_equals_the_norms_then_the_rotation(dtype, dim, with_norm, monkeypatch):
    rotary = RotaryEmbedding(dim, 512, 10000.0)
    q, k, _ = qkv_views(7, 4, 2, dim, dtype)
    positions = torch.tensor([0, 5, 5, 300, 17, 511, 2])  # repeats: overwritten drafts
    q_norm, k_norm = norms(dim, dtype) if with_norm else (None, None)
    called = []
    from strata.layers import rotary_triton
    real = rotary_triton.norm_rotate
    monkeypatch.setattr(rotary_triton, "norm_rotate",
                        lambda *a, **kw: called.append(1) or real(*a, **kw))
    monkeypatch.setattr(RotaryEmbedding, "path", "torch")
    ref = rotary.norm_rotate(q, k, positions, q_norm, k_norm)[:2]
    monkeypatch.setattr(RotaryEmbedding, "path", "triton")
    ours = rotary.norm_rotate(q, k, positions, q_norm, k_norm)[:2]
    assert called == [1]  # the kernel ran, on the triton path only
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        elif dtype == torch.float16:  # rounded where PyTorch rounds: equal but for the
            assert (a != b).float().mean() < 0.01  # norm's reduction order, rarely
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=2e-3)
        else:  # NOTE: triton's interpreter (3.9) truncates float32 to bf16 where a GPU
            # rounds to nearest: within a few bf16 steps here, equal on the GPU
            torch.testing.assert_close(a.float(), b.float(), rtol=4e-2, atol=4e-2)


def test_the_kernel_is_skipped_where_it_does_not_apply(monkeypatch):
    """A head dim not a power of two, a zero-centred norm, a partial table: PyTorch."""
    from strata.layers import rotary_triton
    from strata.layers.norm import ZeroCentredRMSNorm
    monkeypatch.setattr(rotary_triton, "norm_rotate", lambda *a, **kw: pytest.fail("ran"))
    monkeypatch.setattr(RotaryEmbedding, "path", "triton")
    positions = torch.arange(3)
    q, k, _ = qkv_views(3, 2, 1, 24, torch.float32)
    RotaryEmbedding(24, 16, 10000.0).norm_rotate(q, k, positions)
    q, k, _ = qkv_views(3, 2, 1, 64, torch.float32)
    centred = (ZeroCentredRMSNorm(64, 1e-6), ZeroCentredRMSNorm(64, 1e-6))
    RotaryEmbedding(64, 16, 10000.0).norm_rotate(q, k, positions, *centred)
    RotaryEmbedding(64, 16, 10000.0).variant(32).norm_rotate(q, k, positions)


def test_engines_give_the_same_tokens_on_either_path(tmp_path, monkeypatch):
    """A tiny Qwen3 (per-head norms, head dim 32), the triton attention backend, drafts."""
    folder = tmp_path / "qwen3"
    model = build_tiny("qwen3", folder, head_dim=32)
    batch = prompts(3, model.config.vocab_size, seed=5, low=5, high=30)
    batch[0] = batch[0][:5] * 4  # repeats: the lookup proposer drafts
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(folder), attention_backend="triton", parallel=3,
                                 max_context=96, max_window_tokens=48))
    monkeypatch.setattr(RotaryEmbedding, "path", "torch")
    ref = engine.generate(batch, params)
    from strata.layers import rotary_triton
    called = []
    real = rotary_triton.norm_rotate
    monkeypatch.setattr(rotary_triton, "norm_rotate",
                        lambda *a, **kw: called.append(a[-1] is not None) or real(*a, **kw))
    monkeypatch.setattr(RotaryEmbedding, "path", "triton")
    assert engine.generate(batch, params) == ref
    assert called and all(called)  # and it wrote the keys and values itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_the_rotation_writes_keys_and_values_as_the_backend_would(dtype, with_norm):
    """`kv_write`: the kernel also puts the rotated keys and the values (views of one qkv
    projection) into the cache's rows, bit for bit as rotating and then the backend's
    write_kv; rows repeat where a padded window's padding tokens share one."""
    from strata.attention import triton_kernel
    from strata.layers import rotary_triton
    rotary = RotaryEmbedding(64, 64, 10000.0)
    q, k, v = qkv_views(6, 4, 2, 64, dtype)
    weights = tuple(n.weight for n in norms(64, dtype)) if with_norm else None
    positions = torch.tensor([0, 3, 3, 9, 1, 0], dtype=torch.int32)
    rows = torch.tensor([9, 0, 31, 4, 40, 40])
    key, value = torch.randn(2, 41, 2, 64).to(dtype)
    expect_key, expect_value = key.clone(), value.clone()
    rq, rk = rotary_triton.norm_rotate(q, k, rotary.cos, rotary.sin, positions, weights, 1e-6)
    triton_kernel.write_kv(rk, v, expect_key, expect_value, rows)
    assert rotary_triton.writes(k, (v, key, value, rows))
    oq, ok = rotary_triton.norm_rotate(q, k, rotary.cos, rotary.sin, positions, weights, 1e-6,
                                       (v, key, value, rows))
    assert torch.equal(oq, rq) and torch.equal(ok, rk)
    assert torch.equal(key, expect_key) and torch.equal(value, expect_value)
    assert not rotary_triton.writes(k, (v, key.to(torch.float16), value, rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_writes_keys_and_values_as_two_index_copies(dtype):
    """k and v from two projections' views (3 kv heads: 192 values a row, masked to 256)."""
    from strata.attention import triton_kernel
    _, k, v = qkv_views(6, 2, 3, 64, dtype)
    _, k2, _ = qkv_views(6, 2, 3, 64, dtype, seed=1)
    rows = torch.tensor([9, 0, 31, 4, 5, 17])
    key, value = torch.randn(2, 32, 3, 64).to(dtype)
    expect_key, expect_value = key.clone(), value.clone()
    expect_key.index_copy_(0, rows, k2)
    expect_value.index_copy_(0, rows, v)
    triton_kernel.write_kv(k2, v, key, value, rows)
    assert torch.equal(key, expect_key) and torch.equal(value, expect_value)


def _compile(arch: int, dim: int, dtype, norm: bool):
    from strata.attention import triton_kernel
    from strata.layers import rotary_triton

    def types(name: str) -> str:
        return ("*fp32" if name in ("cos_ptr", "sin_ptr") else "*i32" if name == "pos_ptr"
                else "*i64" if name == "slot_ptr" else "fp32" if name == "eps"
                else "*" + TRITON_TYPES[dtype] if name.endswith(("_ptr", "_out", "_weight"))
                else "i32")

    rotate = compile_kernel(rotary_triton._norm_rotate, arch, dict(D=dim, NORM=norm, WRITE=norm),
                            types,
                            dict(num_warps=1, num_stages=2))
    write = compile_kernel(triton_kernel._write_kv, arch,
                           dict(HD=3 * dim, D=dim, BLOCK=triton_kernel.triton.next_power_of_2(
                               3 * dim)), types, dict(num_warps=1, num_stages=2))
    return rotate.metadata.shared + write.metadata.shared


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    code = ("import torch; from test_rotary_triton import _compile\n"
            "print(*[_compile(arch, d, t, n) for d in (64, 128)"
            " for t in (torch.bfloat16, torch.float16) for n in (False, True)])")
    assert len(offline_compiled(code, tmp_path)) == 16
