"""The Gated DeltaNet's convolution and delta rule over a whole window as two Triton kernels
(layers/deltanet.py's reference loop, for the GPU), reading where each entry starts and
which rows it reads and writes from the window's StateMeta on the device: no host sync
and no per-entry launch, so a stage of these layers is captured in CUDA graphs, and a
padded window's extra tokens and entries cost nothing but their own programs.

- `causal_conv`: a program per (token, tile of channels) sums the token's `kernel` inputs
  (its run's earlier tokens, else the entry's stored window, else zeros for a fresh
  entry) times the depthwise weights, applies SiLU, and writes the convolution's window
  after the token (its last `kernel - 1` inputs) to the token's row, if it has one.
- `gated_delta_rule`: a program per (entry, value head, tile of BLOCK_V value columns)
  keeps its [key dim x BLOCK_V] slice of the state in registers and walks the entry's
  tokens in order — the columns of the state evolve independently, so the tiles need no
  exchange — L2-normalising the token's query and key, computing its decay and write
  strength from a and b, writing its output and, where the token has a row, the state
  after it. Everything is float32.

NOTE: a token loop, not a chunked scan: prompt chunks cost a sequential step per token
per program (fine for decode and verify runs of 1..k+1 tokens, slower for long prompts).
The state rows an entry reads are never rows a window writes (the scheduler's versioned
rows), so programs need no ordering between them.
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

from strata.layers.state_meta import StateMeta

BLOCK_C = 256  # channels per convolution program
BLOCK_V = 32   # value columns per delta-rule program


@triton.jit
def _causal_conv(x_ptr, weight_ptr, window_ptr, out_ptr, entry_start_ptr, entry_source_ptr,
                 entry_fresh_ptr, token_entry_ptr, token_index_ptr, token_row_ptr,
                 channels, x_stride, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
    token = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < channels
    # NOTE: a token's scalar conditions enter the masks as bounds (c < channels if so,
    # else 0): triton's interpreter cannot combine a scalar condition with a vector mask.
    entry = tl.load(token_entry_ptr + token)
    index = tl.load(token_index_ptr + token)       # in the entry's run
    start = tl.load(entry_start_ptr + entry)
    stored = tl.load(entry_fresh_ptr + entry) == 0  # the window before the run is read
    source = tl.load(entry_source_ptr + entry)
    row = tl.load(token_row_ptr + token)
    kept = c < tl.where(row >= 0, channels, 0)
    HISTORY: tl.constexpr = KERNEL - 1
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tap in tl.static_range(KERNEL):
        back = index + tap - HISTORY  # the input's index in the run (< 0: in the window)
        run_at = (start + tl.maximum(back, 0)).to(tl.int64) * x_stride
        window_at = (source.to(tl.int64) * HISTORY + tl.minimum(index + tap, HISTORY - 1)) \
            * channels
        in_run = c < tl.where(back >= 0, channels, 0)
        in_window = c < tl.where((back < 0) & stored, channels, 0)
        value = (tl.load(x_ptr + run_at + c, mask=in_run, other=0.0).to(tl.float32)
                 + tl.load(window_ptr + window_at + c, mask=in_window, other=0.0))
        acc += value * tl.load(weight_ptr + c * KERNEL + tap, mask=ok, other=0.0).to(tl.float32)
        if tap >= 1:  # the window after this token: its inputs at taps 1..KERNEL-1
            target = (tl.maximum(row, 0).to(tl.int64) * HISTORY + tap - 1) * channels
            tl.store(window_ptr + target + c, value, mask=kept)
    tl.store(out_ptr + token.to(tl.int64) * channels + c, acc / (1.0 + tl.exp(-acc)), mask=ok)


@triton.jit
def _gated_delta(conv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
                 entry_start_ptr, entry_len_ptr, entry_source_ptr, entry_fresh_ptr,
                 token_row_ptr, channels, a_stride, b_stride, heads, group, key_dim,
                 value_dim, scale, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    entry = tl.program_id(0)
    head = tl.program_id(1)
    kd = tl.arange(0, BLOCK_K)
    vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kd < key_dim
    v_ok = vd < value_dim
    tile = (kd[:, None] * value_dim + vd[None, :]).to(tl.int64)      # within a head's state
    head_size = key_dim * value_dim
    start = tl.load(entry_start_ptr + entry)
    count = tl.load(entry_len_ptr + entry)
    stored = tl.load(entry_fresh_ptr + entry) == 0
    source = tl.load(entry_source_ptr + entry).to(tl.int64)
    read = (kd < tl.where(stored, key_dim, 0))[:, None] & v_ok[None, :]  # (see _causal_conv)
    state = tl.load(state_ptr + (source * heads + head) * head_size + tile, mask=read,
                    other=0.0)
    keys = heads // group * key_dim
    query_at = head // group * key_dim + kd  # the value head's key head, in the q block
    value_at = 2 * keys + head * value_dim + vd
    decay_rate = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for i in range(0, count):
        token = (start + i).to(tl.int64)
        x = tl.load(a_ptr + token * a_stride + head).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))    # torch's threshold
        decay = tl.exp(decay_rate * softplus)
        beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + token * b_stride + head).to(tl.float32)))
        row_at = token * channels
        query = tl.load(conv_ptr + row_at + query_at, mask=k_ok, other=0.0)
        key = tl.load(conv_ptr + row_at + keys + query_at, mask=k_ok, other=0.0)
        value = tl.load(conv_ptr + row_at + value_at, mask=v_ok, other=0.0)
        query = query * (tl.rsqrt(tl.sum(query * query) + 1e-6) * scale)
        key = key * tl.rsqrt(tl.sum(key * key) + 1e-6)
        state = state * decay
        remembered = tl.sum(state * key[:, None], axis=0)             # [BLOCK_V]
        delta = (value - remembered) * beta
        state = state + key[:, None] * delta[None, :]
        tl.store(out_ptr + (token * heads + head) * value_dim + vd,
                 tl.sum(state * query[:, None], axis=0), mask=v_ok)
        row = tl.load(token_row_ptr + token)
        write = (kd < tl.where(row >= 0, key_dim, 0))[:, None] & v_ok[None, :]
        tl.store(state_ptr + (tl.maximum(row, 0).to(tl.int64) * heads + head) * head_size
                 + tile, state, mask=write)


def causal_conv(mixed: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                meta: StateMeta) -> torch.Tensor:
    """mixed [T, C] (rows may be strided), weight [C, 1, kernel], windows [rows, kernel - 1,
    C] float32 (read at each entry's source row, written at each token's row). Returns
    SiLU of the causal convolution [T, C] float32."""
    tokens, channels = mixed.shape
    kernel = weight.shape[-1]
    if mixed.stride(1) != 1:
        mixed = mixed.contiguous()
    out = torch.empty(tokens, channels, dtype=torch.float32, device=mixed.device)
    _causal_conv[(tokens, triton.cdiv(channels, BLOCK_C))](
        mixed, weight.contiguous(), windows, out, meta.entry_start, meta.entry_source,
        meta.entry_fresh, meta.token_entry, meta.token_index, meta.token_row, channels,
        mixed.stride(0), KERNEL=kernel, BLOCK_C=BLOCK_C, num_warps=4)
    return out


def gated_delta_rule(conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, states: torch.Tensor,
                     meta: StateMeta, num_key_heads: int, key_dim: int) -> torch.Tensor:
    """conv [T, C] float32 (q of every key head, then k, then v of every value head, before
    normalisation), a and b [T, Hv] (rows may be strided), a_log and dt_bias [Hv]; states
    [rows, Hv, Dk, Dv] float32. Returns the outputs [T, Hv, Dv] float32."""
    heads, value_dim = states.shape[1], states.shape[3]
    a, b = (t if t.stride(1) == 1 else t.contiguous() for t in (a, b))
    out = torch.empty(conv.shape[0], heads, value_dim, dtype=torch.float32, device=conv.device)
    grid = (meta.entry_len.shape[0], heads, triton.cdiv(value_dim, BLOCK_V))
    _gated_delta[grid](
        conv, a, b, a_log, dt_bias, states, out, meta.entry_start, meta.entry_len,
        meta.entry_source, meta.entry_fresh, meta.token_row, conv.shape[1], a.stride(0),
        b.stride(0), heads, heads // num_key_heads, key_dim, value_dim, key_dim ** -0.5,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=BLOCK_V, num_warps=4)
    return out
