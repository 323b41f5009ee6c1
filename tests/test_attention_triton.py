"""The `triton` backend against `reference` on the same windows (its kernel runs in triton's
interpreter on the CPU, see conftest.py): decode, drafts, prompt chunks over several query
tiles, mixed windows, positions rewritten after a rejection, GQA, odd head dims, a bf16
cache, and padding as a CUDA-graph runner would add it; its metadata's shapes follow the
window's shape only, and a StagingBuffer refills it. The kernel also compiles for SM86 and SM90
(no GPU needed), and whole engines agree on either backend."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import SM86_SHARED, TRITON_TYPES, compile_kernel, offline_compiled, prompts

from strata.attention import AttentionBatch, get_backend
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.kvcache.block_pool import cache_rows
from strata.kvcache.cache import PagedKVCache
from strata.kvcache.spec import PagedKVSpec
from strata.sampling.params import SamplingParams
from strata.stage.staging import StagingBuffer, tensor_fields, with_views

pytest.importorskip("triton")
CPU = torch.device("cpu")
NUM_BLOCKS = 64


def window(runs: list[tuple[int, int]], block_size: int, seed: int = 0,
           tables: list[list[int]] | None = None) -> AttentionBatch:
    """Entries of (first position, tokens), each with its own blocks scattered over the pool
    (or the given `tables`), block 0 left spare."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    if tables is None:
        tables = [[free.pop() for _ in range(-(-(start + count) // block_size))]
                  for start, count in runs]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])       # [B, W]
    positions = torch.cat([torch.arange(start, start + count) for start, count in runs])
    entry = torch.repeat_interleave(torch.arange(len(runs)),
                                    torch.tensor([count for _, count in runs]))
    rows = cache_rows(table, positions, block_size)[entry, torch.arange(len(positions))]
    return AttentionBatch([count for _, count in runs], positions, rows, table, block_size)


def caches(kv_heads: int, dim: int, block_size: int, dtype=torch.float32, seed: int = 1):
    """Two caches with the same random history (earlier positions already written)."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randn(NUM_BLOCKS * block_size, kv_heads, dim, generator=g)
    out = []
    for _ in range(2):
        cache = PagedKVCache(PagedKVSpec(kv_heads, dim), NUM_BLOCKS * block_size, dtype, "cpu")
        cache.key.copy_(history)
        cache.value.copy_(history.flip(0))
        out.append(cache)
    return out


def inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype=torch.float32,
           seed: int = 2):
    """Random q [T, H, D], k and v [T, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    k, v = torch.randn(2, tokens, kv_heads, dim, generator=g).to(dtype)
    return q, k, v


def run_both(batch: AttentionBatch, qkv, pair, scale=None):
    """(reference output, triton output) of the same q, k, v, each on its cache of `pair`;
    the caches agree afterwards. The kernel splits its key walks as on a GPU (16 splits
    for windows of up to 64 tokens; engines on the CPU take one)."""
    from strata.attention import triton_kernel

    def as_on_a_gpu(tokens, device, real=triton_kernel.num_splits):
        return real(tokens, torch.device("cuda"))

    with mock.patch.object(triton_kernel, "num_splits", as_on_a_gpu):
        outs = [backend.forward(*qkv, cache, backend.prepare(batch, CPU), scale)
                for backend, cache in zip((get_backend("reference"), get_backend("triton")),
                                          pair)]
    assert torch.equal(pair[0].key, pair[1].key) and torch.equal(pair[0].value, pair[1].value)
    return outs


WINDOWS = {
    "decode": [(5, 1), (17, 1), (30, 1), (0, 1)],
    "drafts": [(9, 4), (22, 4), (3, 2)],
    "chunk": [(0, 37), (20, 19)],                   # more than one query tile each
    "mixed": [(40, 1), (12, 5), (0, 23), (3, 1)],
}


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("name", WINDOWS)
def test_triton_equals_reference(name, heads, kv_heads):
    batch = window(WINDOWS[name], block_size=4)
    qkv = inputs(len(batch.positions), heads, kv_heads, 64)
    ref, tri = run_both(batch, qkv, caches(kv_heads, 64, 4),
                        scale=0.2 if name == "drafts" else None)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_rows_past_each_context_are_never_used():
    """A program loads its first key step's block numbers before it knows its context's
    end (bounded by the table's width only): rows past each entry's last position, and
    the padding block its table names, hold NaN here, and the output is still the clean
    cache's."""
    from strata.attention import triton_kernel

    batch = window([(5, 1), (40, 1), (1, 2)], block_size=4)
    pair = caches(2, 64, 4)
    q, k, v = inputs(len(batch.positions), 6, 2, 64)
    ref = get_backend("reference").forward(q, k, v, pair[0], get_backend("reference").prepare(
        batch, CPU))
    meta = get_backend("triton").prepare(batch, CPU)
    dirty = pair[1]
    dirty.key.index_copy_(0, meta.slot_mapping, k)
    dirty.value.index_copy_(0, meta.slot_mapping, v)
    used = torch.zeros(dirty.key.shape[0], dtype=torch.bool)
    for entry, (start, count) in enumerate([(5, 1), (40, 1), (1, 2)]):
        for pos in range(start + count):
            used[batch.block_tables[entry, pos // 4] * 4 + pos % 4] = True
    dirty.key[~used] = float("nan")
    dirty.value[~used] = float("nan")
    out = triton_kernel.paged_attention(q, dirty.key, dirty.value, meta.positions,
                                        meta.block_tables, meta.tile_entry, meta.tile_start,
                                        meta.tile_count, 4, 64 ** -0.5, splits=4)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,block_size,heads", [(48, 3, 3), (192, 16, 6)])
def test_odd_head_dims_and_block_sizes(dim, block_size, heads):
    """192 (MLA's padded dim) with a group of 6 also splits the group in two head chunks."""
    batch = window(WINDOWS["mixed"], block_size)
    ref, tri = run_both(batch, inputs(len(batch.positions), heads, 1, dim),
                        caches(1, dim, block_size))
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [16, 1, 4])
def test_long_contexts_split_their_walk(splits):
    """Decoding and verifying over hundreds of positions: the key walk split over programs
    (a GPU's default for so few tokens: 16 splits, most with one step of keys), over 4
    (several steps each), or not at all; a short context beside them (one split with
    keys, the others' partials empty)."""
    from strata.attention import triton_kernel

    batch = window([(600, 1), (290, 4), (20, 1)], block_size=16)
    pair = caches(2, 64, 16)
    q, k, v = inputs(len(batch.positions), 6, 2, 64)
    ref = get_backend("reference").forward(q, k, v, pair[0], get_backend("reference").prepare(
        batch, CPU))
    meta = get_backend("triton").prepare(batch, CPU)
    pair[1].key.index_copy_(0, meta.slot_mapping, k)
    pair[1].value.index_copy_(0, meta.slot_mapping, v)
    tri = triton_kernel.paged_attention(q, pair[1].key, pair[1].value, meta.positions,
                                        meta.block_tables, meta.tile_entry, meta.tile_start,
                                        meta.tile_count, 16, 64 ** -0.5, splits=splits)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_kernel.num_splits(3 * 2, gpu) == 16 and triton_kernel.num_splits(200, gpu) == 1
    assert triton_kernel.num_splits(3 * 2, cpu) == 1


def test_positions_rewritten_after_a_rejection():
    """A verify run writes positions 10..14; 1 draft of 4 is accepted, so the next window
    starts at 12 and rewrites 12 and 13 (13 held a rejected draft): 13 must attend to its
    new key, and the stale 14 is left unread."""
    pair = caches(2, 64, 4)
    first = window([(10, 5), (3, 2)], 4, seed=5)
    second = window([(12, 2), (5, 1)], 4, tables=first.block_tables.tolist())
    for batch, seed in ((first, 2), (second, 3)):
        ref, tri = run_both(batch, inputs(len(batch.positions), 6, 2, 64, seed=seed), pair)
        torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.bfloat16),
                                            (torch.float16, torch.float16),
                                            (torch.bfloat16, torch.bfloat16)])
def test_half_precision_caches(dtype, kv_dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("triton's interpreter multiplies bf16 tl.dot operands as their raw "
                    "uint16 bits (triton 3.9); a bf16 cache is checked with fp32 queries")
    batch = window(WINDOWS["mixed"], 4)
    qkv = inputs(len(batch.positions), 6, 2, 64, dtype)
    ref, tri = run_both(batch, qkv, caches(2, 64, 4, kv_dtype))
    assert tri.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tri.float(), ref.float(), rtol=tol, atol=tol)


def padded(batch: AttentionBatch, tokens: int, entries: int, width: int) -> AttentionBatch:
    """`batch` padded as a CUDA-graph runner would: dummy entries of dummy tokens at
    position 0 (the last one empty), writing and reading only the spare block 0; tables
    widened with block 0."""
    extra_tokens, extra_entries = tokens - len(batch.positions), entries - len(batch.query_lens)
    lens = [extra_tokens - extra_entries + 2] + [1] * (extra_entries - 2) + [0]
    table = torch.zeros(entries, width, dtype=torch.long)
    table[:batch.block_tables.shape[0], :batch.block_tables.shape[1]] = batch.block_tables
    zeros = torch.zeros(extra_tokens, dtype=torch.long)
    return AttentionBatch(batch.query_lens + lens, torch.cat((batch.positions, zeros)),
                          torch.cat((batch.slot_mapping, zeros)), table, batch.block_size)


def test_padding_is_harmless_and_meta_shapes_follow_the_window_shape():
    real = window(WINDOWS["mixed"], 4)
    big = padded(real, tokens=48, entries=7, width=16)
    qkv = inputs(len(real.positions), 6, 2, 64)
    dummies = inputs(48 - len(real.positions), 6, 2, 64, seed=3)
    ref, _ = run_both(real, qkv, caches(2, 64, 4))
    pair = caches(2, 64, 4)
    _, tri = run_both(big, [torch.cat(pads) for pads in zip(qkv, dummies)], pair)
    assert torch.isfinite(tri).all()
    torch.testing.assert_close(tri[:len(real.positions)], ref, rtol=1e-5, atol=1e-5)
    # Another window of the same (T, B, W) gives metadata of the same shapes...
    backend = get_backend("triton")
    other = padded(window([(7, 30)], 4, seed=9), tokens=48, entries=7, width=16)
    captured = backend.prepare_host(big)
    staging = StagingBuffer(tensor_fields(captured), CPU)
    static, new = with_views(captured, iter(staging.views)), backend.prepare(other, CPU)
    # ...so copying it into the captured one's buffer replays the new window exactly.
    q, k, v = inputs(48, 6, 2, 64, seed=4)
    expected = backend.forward(q, k, v, pair[1], new)
    scratch = caches(2, 64, 4)[0]  # the captured window's own output, elsewhere
    assert not torch.equal(backend.forward(q, k, v, scratch, static), expected)
    staging.fill(tensor_fields(backend.prepare_host(other)))
    torch.testing.assert_close(backend.forward(q, k, v, pair[1], static), expected,
                               rtol=0, atol=0)
    with pytest.raises(StrataError, match=r"tensor 0 is \(30,\) torch.int64, its view \(48,\)"):
        staging.fill(tensor_fields(backend.prepare_host(window([(7, 30)], 4, seed=9))))


def compile_offline(arch: int, head_dim: int, group: int, q_dtype, kv_dtype,
                    splits: int = 1):
    """The kernel as triton compiles it for an NVIDIA GPU of compute capability `arch`
    (no GPU needed), with the constants the launcher would pass."""
    from strata.attention import triton_kernel

    constants, num_warps = triton_kernel.kernel_constants(head_dim, group, q_dtype, kv_dtype, 16)
    constants["NUM_SPLITS"] = splits

    def types(name: str) -> str:
        return ("*" + TRITON_TYPES[q_dtype] if name in ("q_ptr", "out_ptr") else
                "*" + TRITON_TYPES[kv_dtype] if name in ("key_ptr", "value_ptr") else
                "*fp32" if name.startswith("split_") else
                "*i32" if name.endswith("_ptr") else
                "fp32" if name == "qk_scale" else "i32")

    if splits > 1:  # the combining kernel must compile too
        compile_kernel(triton_kernel._combine_splits, arch,
                       {k: constants[k] for k in ("HEAD_DIM", "BLOCK_D", "NUM_SPLITS")},
                       types, dict(num_warps=1, num_stages=2))
    return compile_kernel(triton_kernel._paged_attention, arch, constants, types,
                          dict(num_warps=num_warps, num_stages=2))


SERVED = [(64, 3, "bfloat16", "bfloat16"),   # SmolLM2: head dim, GQA group, q, cache
          (128, 8, "float16", "float16"),     # qwen3
          (192, 1, "bfloat16", "float32"),    # MLA, padded
          (48, 2, "float32", "float32")]


def test_the_kernel_compiles_for_rtx3090_and_h200(tmp_path):
    """The interpreter runs what the GPU compiler may reject (types, layouts, shared
    memory): compile the shapes we serve for SM86 and SM90, without a GPU. In a fresh
    process, since the compiler cannot run where the interpreter is chosen."""
    code = ("import torch; from test_attention_triton import SERVED, compile_offline\n"
            "print(*[compile_offline(arch, d, g, getattr(torch, q), getattr(torch, kv), s)"
            ".metadata.shared for d, g, q, kv in SERVED for s in (1, 16)])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 2 * 2 * len(SERVED)
    assert max(shared) <= SM86_SHARED


def test_importing_strata_does_not_import_triton():
    code = "import sys, strata.attention, strata.engine.engine; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_triton_and_cpu_devices_are_clear_errors(monkeypatch, tiny_models):
    backend = get_backend("triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    cpu_error = "runs on CUDA devices; use --attention-backend reference on the CPU"
    with pytest.raises(StrataError, match=cpu_error):
        backend.prepare(window([(0, 1)], 4), CPU)
    if not torch.cuda.is_available():  # refused when the stage is built
        with pytest.raises(StrataError, match=cpu_error):
            Engine(EngineConfig(model=str(tiny_models["llama"][0]), attention_backend="triton"))
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now fails
    with pytest.raises(StrataError, match="needs the triton package: pip install "
                                          "'strata\\[gpu\\]'"):
        get_backend("triton")


def engines(folder, **kw) -> list[Engine]:
    return [Engine(EngineConfig(model=str(folder), attention_backend=name, **kw))
            for name in ("reference", "triton")]


def test_engines_on_reference_and_triton_give_the_same_tokens(tiny_models):
    """Prompt chunks over several tiles, then decode with suffix and lookup drafts."""
    folder, model = tiny_models["llama"]
    batch = prompts(3, model.config.vocab_size, seed=12, low=5, high=40)
    batch[0] = batch[0][:6] * 4                   # repeats: the lookup proposer drafts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference, triton = engines(folder, parallel=3, max_context=128, max_window_tokens=48)
    assert triton.generate(batch, params) == reference.generate(batch, params)
    assert sum(s.drafted for s in triton.scheduler.drafts.stats.by_proposer.values()) > 0


def test_mla_and_mtp_engines_on_triton(tmp_path):
    """MLA pads its heads to the cache's head dim (24 here: not a power of two)."""
    from test_models_glm_deepseek import build  # a tiny DeepSeek-V3 with its MTP layer

    build("deepseek_v3", tmp_path)
    reference, triton = engines(tmp_path, spec=2, spec_type=("mtp",), spec_min_p=0.0,
                                spec_token_cost=0.0, max_context=128)
    ids = prompts(2, 320, seed=5, low=8, high=20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert triton.generate(ids, params) == reference.generate(ids, params)
    assert triton.scheduler.drafts.stats.by_proposer["mtp"].drafted > 0
