"""The Gated DeltaNet's state under drafts (layers/deltanet.py), as a property: random
sequences of windows — prompt chunks, decoding runs with random draft lengths, random
acceptance, two slots in one window — leave every slot's state and every committed
output equal to running its accepted tokens in one go, choosing rows as the scheduler
does (the state after j accepted drafts in the entry's column 1 + j). The GPU's kernels
for the convolution and the delta rule (deltanet_triton.py, in triton's interpreter here)
equal the reference loop over windows of several entries padded as for a CUDA graph, and
compile for SM86 and SM90."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kvcache.cache import SlotStateCache
from strata.layers.deltanet import GatedDeltaNet, state_spec
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory
from strata.layers.state_meta import StateMeta

HIDDEN, MAX_DRAFTS, LENGTH = 16, 4, 40
ROWS = 2 + MAX_DRAFTS  # per slot


def layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    module = GatedDeltaNet(HIDDEN, num_key_heads=2, num_value_heads=4, key_dim=8, value_dim=4,
                           conv_kernel=4, eps=1e-6, linear=LinearFactory())
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.4)
    return module


LAYER = layer()
TRUE = torch.randn(2, LENGTH, HIDDEN, generator=torch.Generator().manual_seed(1))


def meta(entries: list[tuple[int, int, list[int], int]]) -> ForwardMeta:
    """entries: (first position, tokens, state rows, drafts) per entry."""
    return ForwardMeta(
        positions=torch.cat([torch.arange(p, p + n) for p, n, _, _ in entries]),
        logits_idx=torch.zeros(0, dtype=torch.long), backend=None, attention=None,
        state=StateMeta.build([n for _, n, _, _ in entries], [p for p, _, _, _ in entries],
                              [k for _, _, _, k in entries],
                              torch.tensor([rows for _, _, rows, _ in entries])))


def one_go(slot: int, length: int, cache: SlotStateCache):
    """Outputs and final state of the slot's first `length` true inputs in one window."""
    out = LAYER(TRUE[slot, :length], meta([(0, length, list(range(ROWS)), 0)]), cache)
    return out, [t[1].clone() for t in cache.tensors]


window = st.tuples(st.integers(1, 6), st.integers(0, MAX_DRAFTS), st.floats(0, 1))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(window, window), min_size=1, max_size=12), st.integers(0, 2 ** 16))
def test_rolled_back_state_equals_running_the_accepted_tokens(windows, seed):
    garbage = torch.Generator().manual_seed(seed)
    spec = state_spec(2, 4, 8, 4, 4)
    cache = SlotStateCache(spec, 2 * ROWS, "cpu")
    rows = [list(range(s * ROWS, (s + 1) * ROWS)) for s in range(2)]
    current = [rows[0][0], rows[1][0]]
    done = [0, 0]
    outputs = [[], []]
    with torch.no_grad():
        for pair in windows:
            entries, inputs, plan = [], [], []
            for slot, (known, drafts, share) in enumerate(pair):
                known = min(known, LENGTH - done[slot] - drafts - 1)
                if known < 1:
                    continue
                accepted = round(share * drafts)
                start = done[slot]
                x = TRUE[slot, start:start + known + accepted]
                wrong = torch.randn(drafts - accepted, HIDDEN, generator=garbage)
                inputs.append(torch.cat([x, wrong]))
                order = [current[slot], *(r for r in rows[slot] if r != current[slot])]
                entries.append((start, known + drafts, order, drafts))
                plan.append((slot, known, accepted, order))
            if not entries:
                continue
            out = LAYER(torch.cat(inputs), meta(entries), cache)
            offset = 0
            for (slot, known, accepted, order), (_, n, _, _) in zip(plan, entries):
                outputs[slot].append(out[offset:offset + known + accepted])
                current[slot] = order[1 + accepted]
                done[slot] += known + accepted
                offset += n
        for slot in range(2):
            if not done[slot]:
                continue
            fresh = SlotStateCache(spec, ROWS, "cpu")
            want, state = one_go(slot, done[slot], fresh)
            torch.testing.assert_close(torch.cat(outputs[slot]), want, rtol=1e-4, atol=1e-5)
            for got, expected in zip((t[current[slot]] for t in cache.tensors), state):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


run = st.tuples(st.integers(1, 9), st.integers(0, 8), st.booleans())


@settings(max_examples=10, deadline=None)
@given(st.lists(run, min_size=1, max_size=3), st.integers(0, 3), st.integers(0, 2),
       st.integers(0, 2 ** 16))
def test_the_triton_kernels_equal_the_token_loop(runs, pad_tokens, pad_entries, seed):
    """deltanet_triton's kernels (triton's interpreter on the CPU) against the reference
    loop, over windows of 1..3 entries, each of any length and kept tail, fresh or not,
    padded as for a CUDA-graph bucket: outputs and every state row (the padding writes
    none); key dim 8 and value dim 4 below the kernels' tiles (masked)."""
    pytest.importorskip("triton")
    runs = [(n, min(drafts, n - 1, MAX_DRAFTS), fresh) for n, drafts, fresh in runs]
    g = torch.Generator().manual_seed(seed)
    real = sum(n for n, _, _ in runs)
    x = torch.randn(real + pad_tokens, HIDDEN, generator=g)
    rows = torch.arange(len(runs) * ROWS).view(len(runs), ROWS)
    state = StateMeta.build([n for n, _, _ in runs], [0 if fresh else 5 for _, _, fresh in runs],
                            [d for _, d, _ in runs], rows, real + pad_tokens,
                            len(runs) + (pad_tokens > 0) + pad_entries)
    window = ForwardMeta(positions=torch.zeros(real + pad_tokens, dtype=torch.long),
                         logits_idx=torch.zeros(0, dtype=torch.long), backend=None,
                         attention=None, state=state)
    results = []
    for path in ("reference", "triton"):
        cache = SlotStateCache(state_spec(2, 4, 8, 4, 4), len(runs) * ROWS, "cpu")
        for t in cache.tensors:  # the same prior state for both paths
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 1)))
        LAYER.path = path
        try:
            with torch.no_grad():
                out = LAYER(x, window, cache)
        finally:
            LAYER.path = "auto"
        results.append((out[:real], [t.clone() for t in cache.tensors]))
    (want, want_state), (got, got_state) = results
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_state, want_state):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_state_meta_names_each_kept_token_row_and_pads_with_nothing():
    """Rows after the last known token and each draft; a padded window's extra tokens form
    one fresh entry that writes nothing, its extra entries are empty."""
    rows = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    meta = StateMeta.build([3, 1], [7, 0], [2, 0], rows, num_tokens=6, num_entries=4)
    assert meta.entry_start.tolist() == [0, 3, 4, 6]
    assert meta.entry_len.tolist() == [3, 1, 2, 0]
    assert meta.entry_source.tolist() == [10, 20, 0, 0]
    assert meta.entry_fresh.tolist() == [0, 1, 1, 1]
    assert meta.token_entry.tolist() == [0, 0, 0, 1, 2, 2]
    assert meta.token_index.tolist() == [0, 1, 2, 0, 0, 1]
    assert meta.token_row.tolist() == [11, 12, 13, 21, -1, -1]
    prompt = StateMeta.build([5], [0], [0], rows[:1])  # a prompt chunk keeps its last state
    assert prompt.token_row.tolist() == [-1, -1, -1, -1, 11]
    blank = StateMeta.build([1], [0], [0], None, num_tokens=2, num_entries=3)
    assert blank.token_row.tolist() == [-1, -1] and blank.entry_fresh.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="do not fit"):
        StateMeta.build([3, 1], [7, 0], [2, 0], rows, num_tokens=6, num_entries=2)


def compile_kernels(arch: int):
    """deltanet_triton's kernels as the launchers pass them for Qwen3-Next's heads (key
    and value dims 128, conv kernel 4), compiled for compute capability `arch` without a
    GPU."""
    from conftest import compile_kernel

    from strata.layers import deltanet_triton

    def types(name: str) -> str:
        if name in ("x_ptr", "a_ptr", "b_ptr", "weight_ptr", "a_log_ptr", "dt_bias_ptr"):
            return "*bf16"
        if name.endswith("_ptr"):
            return "*fp32" if name in ("window_ptr", "out_ptr", "conv_ptr", "state_ptr") \
                else "*i64"
        return "fp32" if name == "scale" else "i32"

    options = dict(num_warps=4)
    return [compile_kernel(deltanet_triton._causal_conv, arch,
                           dict(KERNEL=4, BLOCK_C=deltanet_triton.BLOCK_C), types, options),
            compile_kernel(deltanet_triton._gated_delta, arch,
                           dict(BLOCK_K=128, BLOCK_V=deltanet_triton.BLOCK_V), types, options)]


def test_the_kernels_compile_for_rtx3090_and_h200(tmp_path):
    from conftest import SM86_SHARED, offline_compiled
    code = ("from test_deltanet_rollback import compile_kernels\n"
            "print(*[k.metadata.shared for k in compile_kernels(arch)])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 4 and max(shared) <= SM86_SHARED


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 150), st.sampled_from([8, 16, 64]), st.booleans(),
       st.integers(0, 2 ** 16))
def test_the_chunked_delta_rule_equals_the_token_loop(n, chunk, fresh, seed):
    """chunked_delta_rule (prompt chunks) against one step per token: outputs and the
    final state, across chunk boundaries and a last chunk cut short."""
    from strata.layers.deltanet import _l2norm, chunked_delta_rule

    g = torch.Generator().manual_seed(seed)
    heads, dk, dv = 3, 8, 4
    q = _l2norm(torch.randn(n, heads, dk, generator=g)) / dk ** 0.5
    k = _l2norm(torch.randn(n, heads, dk, generator=g))
    v = torch.randn(n, heads, dv, generator=g)
    decay = -torch.rand(n, heads, generator=g) * 2   # log decays, down to e^-2 a token
    beta = torch.rand(n, heads, generator=g)
    state = torch.zeros(heads, dk, dv) if fresh else torch.randn(heads, dk, dv, generator=g)
    got, got_state = chunked_delta_rule(q, k, v, decay, beta, state, chunk)
    want = torch.empty(n, heads, dv)
    for i in range(n):
        state = state * decay[i].exp()[:, None, None]
        delta = (v[i] - (state * k[i][:, :, None]).sum(1)) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        want[i] = (state * q[i][:, :, None]).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, state, rtol=1e-4, atol=1e-5)
