"""The Triton kernel of the `triton` backend: attention straight from the paged KV cache.

Imported only when the backend is built (triton is an optional dependency). One program
serves one query tile and one kv head (or a chunk of its query heads): the tile's tokens
are up to BLOCK_M consecutive tokens of one window entry, and its rows are those tokens x
the query heads that share the kv head, so GQA reads every key once per tile. The program
walks its entry's key positions 0..(the tile's largest position) BLOCK_N at a time, each
key's cache row looked up through the entry's block table, and keeps an online softmax
in fp32 (exp2). A row attends to key positions up to its own token's position; keys of
positions above a query's are read but masked.

A window of few tiles (decoding) would leave most of the GPU idle while each program walks
its whole context, so its walk is split: the NUM_SPLITS programs of a tile and head take
its key steps in turn (program s steps s, s + NUM_SPLITS, ...) and store unnormalised
partials (acc, max, sum), and `_combine_splits` merges them. The split count follows the
window's size only, never the context, so graphs capture it like the rest; programs past
a tile's context end at once. A decoding program runs one step for contexts of up to
NUM_SPLITS * BLOCK_N keys, and its first step's block numbers are loaded before its
positions are known (masked by the table's width until then).

NOTE: nothing here syncs with the host or allocates by data: the loop bound is loaded by
the program itself, so a launch can be captured in a CUDA graph. Tile sizes are fixed from
the head dim and dtypes (no autotuning: a fresh machine compiles in seconds), and only
long-stable triton.language is used (load/store/dot/where/maximum/exp2): checked to
compile for SM86 and SM90 with triton 3.5 (torch 2.11's) and 3.9.
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernel's
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers import pdl

BLOCK_M = 16  # tokens per query tile (the tile map in triton_paged.py is built with it)
LOG2_E = 1.4426950408889634  # the kernel's softmax uses exp2
SPLIT_TOKENS = 64  # windows of up to this many tokens split their walks
MAX_SPLITS = 16


# NOTE: sizes that change with every window are not specialised on (triton would compile
# a variant per divisibility by 16 while serving).
@triton.jit(do_not_specialize=["stride_table", "table_width", "num_tokens"])
def _paged_attention(
        q_ptr, out_ptr, key_ptr, value_ptr,              # [T, H, D] x2, [rows, Hkv, D] x2
        split_acc_ptr, split_ml_ptr,                     # [S, T, H, BLOCK_D], [S, T, H, 2]
        positions_ptr, block_tables_ptr,                 # [T], [B, W]
        tile_entry_ptr, tile_start_ptr, tile_count_ptr,  # [tiles] each
        stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
        stride_ot, stride_oh, stride_table, table_width,
        qk_scale,                                        # includes log2(e)
        num_tokens, num_heads,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, GROUP_BLOCK: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE_FP32: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS
    split = tl.program_id(2)
    # Before the wait (pdl.py): the window's metadata, which no kernel writes (the tile,
    # its tokens' positions, its first step's block numbers); q and the cache after it.
    entry = tl.load(tile_entry_ptr + tile).to(tl.int64)
    first = tl.load(tile_start_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    table = block_tables_ptr + entry * stride_table
    # This program's key steps: split, split + NUM_SPLITS, ... (BLOCK_N keys each). The
    # first one's block numbers are loaded before the tile's positions say how far its
    # keys go (the table's width bounds them): one round trip to memory fewer before the
    # keys and values are read. Its keys past the tile's last position are never read.
    key_pos = split * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N]
    block = tl.load(table + key_pos // BLOCK_SIZE,
                    mask=key_pos // BLOCK_SIZE < tl.where(count > 0, table_width, 0),
                    other=0).to(tl.int64)
    # Rows: token (row // GROUP_BLOCK) of the tile x query head (row % GROUP_BLOCK) of the
    # chunk. Rows past the tile's tokens or the group's heads load zeros and store nothing;
    # rows without a token take position -1: they attend to nothing and are never stored,
    # and an empty tile (padding of the tile map) runs no key block at all.
    row = tl.arange(0, BLOCK_M * GROUP_BLOCK)
    token = row // GROUP_BLOCK
    group_head = chunk * GROUP_BLOCK + row % GROUP_BLOCK
    head = kv_head * GROUP + group_head
    row_ok = (token < count) & (group_head < GROUP)
    q_pos = tl.load(positions_ptr + first + token, mask=token < count, other=-1)  # [ROWS]
    end = tl.max(q_pos, axis=0) + 1
    if PDL:  # the next kernel may launch now: it reads nothing of ours before its wait
        pdl.release()
        pdl.wait()
    dim = tl.arange(0, BLOCK_D)
    dim_ok = dim < HEAD_DIM
    q_rows = (first + token) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dim[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)   # [ROWS, BLOCK_D]
    m_i = tl.full([BLOCK_M * GROUP_BLOCK], -1.0e30, dtype=tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_M * GROUP_BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_BLOCK, BLOCK_D], dtype=tl.float32)
    for start in range(split * BLOCK_N, end, NUM_SPLITS * BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)                            # [BLOCK_N]
        key_ok = key_pos < end
        cache_row = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
        k_t = tl.load(key_ptr + cache_row[None, :] * stride_kr + kv_head * stride_kh
                      + dim[:, None], mask=key_ok[None, :] & dim_ok[:, None],
                      other=0.0).to(q.dtype)                               # [BLOCK_D, BLOCK_N]
        v = tl.load(value_ptr + cache_row[:, None] * stride_vr + kv_head * stride_vh
                    + dim[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                    other=0.0).to(q.dtype)                                 # [BLOCK_N, BLOCK_D]
        if IEEE_FP32:
            qk = tl.dot(q, k_t, input_precision="ieee")
        else:
            qk = tl.dot(q, k_t)                                            # [ROWS, BLOCK_N]
        qk = tl.where(key_pos[None, :] <= q_pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        after = key_pos + NUM_SPLITS * BLOCK_N  # the next step's block numbers
        block = tl.load(table + after // BLOCK_SIZE, mask=after < end, other=0).to(tl.int64)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = (first + token) * stride_ot + head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + dim[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])
    else:  # every split stores its partials, an empty range too (max -1e30, sum 0)
        part = (split * num_tokens + first + token) * num_heads + head            # [ROWS]
        tl.store(split_acc_ptr + part[:, None] * BLOCK_D + dim[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(split_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(split_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_splits(
        split_acc_ptr, split_ml_ptr, out_ptr,            # partials as stored above, [T, H, D]
        stride_ot, stride_oh, num_tokens, num_heads,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PDL: tl.constexpr):
    """One program per (token, head): the splits' partial softmaxes rescaled to their
    common maximum and summed."""
    if PDL:  # the next kernel may launch now: it reads nothing of ours before its wait
        pdl.release()
        pdl.wait()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.arange(0, NUM_SPLITS)
    part = (split * num_tokens + token) * num_heads + head                        # [S]
    m = tl.load(split_ml_ptr + part * 2)
    weight = tl.exp2(m - tl.max(m, axis=0))                                        # [S]
    total = tl.sum(tl.load(split_ml_ptr + part * 2 + 1) * weight, axis=0)
    dim = tl.arange(0, BLOCK_D)
    acc = tl.load(split_acc_ptr + part[:, None] * BLOCK_D + dim[None, :])        # [S, D]
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dim,
             out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_DIM)


def kernel_constants(head_dim: int, group: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                     block_size: int) -> tuple[dict[str, int | bool], int]:
    """The kernel's constexprs and num_warps for a head dim, GQA group, dtypes and block
    size. A tile's queries take at most 16 KB and its key and value blocks at most 32 KB
    together (up to 128 keys a step: a decoding tile's walk over a long context is a
    chain of dependent loads, so fewer, larger steps finish sooner): shared memory stays
    within SM86's 99 KB (checked by compiling for SM86 and SM90 in
    tests/test_attention_triton.py)."""
    q_size, kv_size = max(q_dtype.itemsize, 2), max(kv_dtype.itemsize, 2)
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = max(BLOCK_M, 16384 // (block_d * q_size))
    group_block = min(triton.next_power_of_2(group), max(1, rows // BLOCK_M))
    constants = dict(
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
        GROUP_BLOCK=group_block, HEAD_CHUNKS=triton.cdiv(group, group_block),
        BLOCK_N=max(16, min(128, 32768 // (2 * block_d * max(q_size, kv_size)))),
        BLOCK_D=block_d, IEEE_FP32=q_dtype == torch.float32)
    num_warps = 4 if BLOCK_M * group_block * block_d * q_size <= 8192 else 8
    return constants, num_warps


def num_splits(tokens: int, device: torch.device) -> int:
    """Splits of each program's key walk for a window of `tokens` tokens on `device`:
    MAX_SPLITS for decoding and verifying windows on a GPU (a few tiles: the GPU would
    idle), 1 for prompt chunks. Two values by the window's size alone: graph buckets of
    both sizes compile both at capture, so no window compiles a new variant while serving.
    On the CPU (triton's interpreter runs the programs one after another) splits only add
    programs: 1 (a CPU test's engine ran 8x slower with 16; the kernel tests ask for
    splits explicitly)."""
    return MAX_SPLITS if tokens <= SPLIT_TOKENS and device.type == "cuda" else 1


def paged_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    positions: torch.Tensor, block_tables: torch.Tensor,
                    tile_entry: torch.Tensor, tile_start: torch.Tensor,
                    tile_count: torch.Tensor, block_size: int, scale: float,
                    splits: int | None = None) -> torch.Tensor:
    """q [T, H, D] attends through `block_tables` [B, W] to `key`/`value` [rows, Hkv, D]
    -> [T, H, D] in q's dtype. Tokens are grouped in tiles (tile_* [tiles], see
    triton_paged.py); the cache must already hold the window's own keys and values.
    `splits`: of each key walk (a power of two; default `num_splits` of the launch)."""
    tokens, heads, head_dim = q.shape
    kv_heads = key.shape[1]
    constants, num_warps = kernel_constants(head_dim, heads // kv_heads, q.dtype, key.dtype,
                                            block_size)
    out = torch.empty_like(q)
    grid = (tile_entry.shape[0], kv_heads * constants["HEAD_CHUNKS"])
    splits = splits or num_splits(tokens, q.device)
    block_d = constants["BLOCK_D"]
    if splits > 1:  # the partials, allocated by the launch's shape (graphs capture them)
        split_acc = torch.empty(splits, tokens, heads, block_d, dtype=torch.float32,
                                device=q.device)
        split_ml = torch.empty(splits, tokens, heads, 2, dtype=torch.float32, device=q.device)
    else:
        split_acc = split_ml = out  # not read
    _paged_attention[grid + (splits,)](
        q, out, key, value, split_acc, split_ml, positions, block_tables, tile_entry,
        tile_start, tile_count,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1],
        scale * LOG2_E, tokens, heads,
        **constants, NUM_SPLITS=splits, **pdl.constants(q.device), num_warps=num_warps,
        num_stages=2)
    if splits > 1:
        _combine_splits[(tokens, heads)](
            split_acc, split_ml, out, out.stride(0), out.stride(1), tokens, heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, **pdl.constants(q.device),
            num_warps=1)
    return out


@triton.jit
def _write_kv(k_ptr, v_ptr, key_ptr, value_ptr, slot_ptr,
              stride_kt, stride_kh, stride_vt, stride_vh,
              HD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program t writes token t's keys and values [Hkv, D] to cache row slot_mapping[t]."""
    if PDL:
        pdl.wait()
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < HD
    head, d = i // D, i % D
    row = tl.load(slot_ptr + t).to(tl.int64) * HD
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=ok)
    if PDL:
        pdl.release()
    tl.store(key_ptr + row + i, k, mask=ok)
    tl.store(value_ptr + row + i, v, mask=ok)


def write_kv(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key[slot_mapping[t]] = k[t] and value[slot_mapping[t]] = v[t] for k, v [T, Hkv, D]
    (any strides but a head's dims contiguous) and the cache tensors [rows, Hkv, D] of the
    same dtype: both in one launch, where two index copies take two."""
    tokens, heads, d = k.shape
    if tokens == 0:
        return
    assert k.stride(-1) == v.stride(-1) == 1 and key.is_contiguous() and value.is_contiguous()
    assert k.dtype == v.dtype == key.dtype == value.dtype
    _write_kv[(tokens,)](k, v, key, value, slot_mapping, k.stride(0), k.stride(1),
                         v.stride(0), v.stride(1), HD=heads * d, D=d,
                         BLOCK=triton.next_power_of_2(heads * d), **pdl.constants(k.device),
                         num_warps=1)
