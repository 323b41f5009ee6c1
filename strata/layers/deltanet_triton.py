"""The gated delta rule of one entry's run as one Triton kernel (layers/deltanet.py's
token loop, for the GPU): a program per (value head, tile of BLOCK_V value columns)
keeps its [key dim x BLOCK_V] slice of the state in registers and walks the run's tokens
in order — the columns of the state evolve independently, so the tiles need no
exchange — writing each token's output and, for the tokens whose state the verifier may
keep, that state into its row. Inputs are the reference's, already prepared (q and k
L2-normalised and repeated per value head, q scaled; g and beta in float32); everything
is float32. No host sync: the run's length, its first kept token and whether it starts
fresh are plain arguments, its rows a device tensor.

NOTE: a token loop, not a chunked scan: prompt chunks cost a sequential step per token
per program (fine for decode and verify runs of 1..k+1 tokens, slow for long prompts).
"""

# NOTE: no `from __future__ import annotations` here: triton reads the kernels'
# `tl.constexpr` annotations as objects.
import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value columns per program


# NOTE: the run's length, first kept token and freshness change every window: not
# specialised (triton would compile a variant for each of them equal to 1, mid-serving).
@triton.jit(do_not_specialize=["num_tokens", "keep", "fresh"])
def _gated_delta(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, rows_ptr, out_ptr,
                 num_tokens, keep, fresh, heads, key_dim, value_dim,
                 BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    head = tl.program_id(0)
    kd = tl.arange(0, BLOCK_K)
    vd = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kd < key_dim
    v_ok = vd < value_dim
    tile = (kd[:, None] * value_dim + vd[None, :]).to(tl.int64)      # within a head's state
    tile_ok = k_ok[:, None] & v_ok[None, :]
    head_size = key_dim * value_dim
    if fresh:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    else:
        source = tl.load(rows_ptr).to(tl.int64)
        state = tl.load(state_ptr + (source * heads + head) * head_size + tile, mask=tile_ok,
                        other=0.0)
    for i in range(0, num_tokens):
        at = i * heads + head
        decay = tl.exp(tl.load(g_ptr + at))
        beta = tl.load(beta_ptr + at)
        key = tl.load(k_ptr + at * key_dim + kd, mask=k_ok, other=0.0)
        query = tl.load(q_ptr + at * key_dim + kd, mask=k_ok, other=0.0)
        value = tl.load(v_ptr + at * value_dim + vd, mask=v_ok, other=0.0)
        state = state * decay
        remembered = tl.sum(state * key[:, None], axis=0)             # [BLOCK_V]
        delta = (value - remembered) * beta
        state = state + key[:, None] * delta[None, :]
        tl.store(out_ptr + at * value_dim + vd, tl.sum(state * query[:, None], axis=0),
                 mask=v_ok)
        if i >= keep:
            target = tl.load(rows_ptr + 1 + i - keep).to(tl.int64)
            tl.store(state_ptr + (target * heads + head) * head_size + tile, state,
                     mask=tile_ok)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, rows: torch.Tensor, keep: int,
                     fresh: bool) -> torch.Tensor:
    """One run of n tokens: q, k [n, Hv, Dk], v [n, Hv, Dv], g and beta [n, Hv] (float32);
    states [rows, Hv, Dk, Dv] float32, read at rows[0] (unless `fresh`: zeros), written
    after token i >= keep at rows[1 + i - keep]. Returns the outputs [n, Hv, Dv] float32."""
    n, heads, key_dim = k.shape
    value_dim = v.shape[2]
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(n, heads, value_dim, dtype=torch.float32, device=v.device)
    _gated_delta[(heads, triton.cdiv(value_dim, BLOCK_V))](
        q, k, v, g, beta, states, rows, out, n, keep, int(fresh), heads, key_dim, value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=BLOCK_V, num_warps=4)
    return out
