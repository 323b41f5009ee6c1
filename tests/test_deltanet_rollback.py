"""The Gated DeltaNet's state under drafts (layers/deltanet.py), as a property: random
sequences of windows — prompt chunks, decoding runs with random draft lengths, random
acceptance, two slots in one window — leave every slot's state and every committed
output equal to running its accepted tokens in one go, choosing rows as the scheduler
does (the state after j accepted drafts in the entry's column 1 + j). The GPU's kernel
for the delta rule (deltanet_triton.py, in triton's interpreter here) equals the
reference loop, and compiles for SM86 and SM90."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.kvcache.cache import SlotStateCache
from strata.layers.deltanet import GatedDeltaNet, state_spec
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory

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
        logits_idx=torch.zeros(0, dtype=torch.long),
        query_lens=tuple(n for _, n, _, _ in entries), backend=None, attention=None,
        state_rows=torch.tensor([rows for _, _, rows, _ in entries]),
        num_drafts=tuple(k for _, _, _, k in entries),
        starts=tuple(p for p, _, _, _ in entries))


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


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 9), st.integers(0, 8), st.booleans(), st.integers(0, 2 ** 16))
def test_the_triton_kernel_equals_the_token_loop(n, drafts, fresh, seed):
    """deltanet_triton's kernel (triton's interpreter on the CPU) against the reference
    loop: outputs and every state row written, fresh or not, any run length and kept
    tail; key dim 8 and value dim 4 below the kernel's tile (masked)."""
    pytest.importorskip("triton")
    drafts = min(drafts, n - 1, MAX_DRAFTS)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    start = 0 if fresh else 5
    results = []
    for path in ("reference", "triton"):
        spec = state_spec(2, 4, 8, 4, 4)
        cache = SlotStateCache(spec, ROWS, "cpu")
        for t in cache.tensors:  # the same prior state for both paths
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 1)))
        LAYER.path = path
        try:
            with torch.no_grad():
                out = LAYER(x, meta([(start, n, list(range(ROWS)), drafts)]), cache)
        finally:
            LAYER.path = "auto"
        results.append((out, [t.clone() for t in cache.tensors]))
    (want, want_state), (got, got_state) = results
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_state, want_state):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def compile_delta_rule(arch: int):
    """deltanet_triton's kernel as the launcher passes it for Qwen3-Next's heads (key and
    value dims 128), compiled for compute capability `arch` without a GPU."""
    from conftest import compile_kernel

    from strata.layers import deltanet_triton

    def types(name: str) -> str:
        return "*i64" if name == "rows_ptr" else "*fp32" if name.endswith("_ptr") else "i32"

    return compile_kernel(deltanet_triton._gated_delta, arch,
                          dict(BLOCK_K=128, BLOCK_V=deltanet_triton.BLOCK_V), types,
                          dict(num_warps=4))


def test_the_kernel_compiles_for_rtx3090_and_h200(tmp_path):
    from conftest import SM86_SHARED, offline_compiled
    code = ("from test_deltanet_rollback import compile_delta_rule\n"
            "print(*[compile_delta_rule(arch).metadata.shared for arch in (86, 90)])")
    shared = offline_compiled(code, tmp_path)
    assert len(shared) == 2 and max(shared) <= SM86_SHARED
