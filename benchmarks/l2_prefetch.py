"""What asking o_proj's weight into L2 while attention runs saves (--l2-prefetch): us a layer
of a decode window's attention half, with and without the ask.

    .venv/bin/python benchmarks/l2_prefetch.py --device cuda:0
    .venv/bin/python benchmarks/l2_prefetch.py --device cuda:0 --shape 576,9,3,64 --contexts 128

One token through --layers layers of [input norm -> q/k/v GEMV -> (the ask:
strata/layers/l2_prefetch.py) -> paged attention over --context keys -> o_proj GEMV], each
layer its own random weights (so that no weight is in L2 but by the ask), Strata's Triton
kernels as a decode window runs them (PDL on where the GPU has it; no rotation), captured
in one CUDA graph and replayed --repeats times; the median of five such timings, divided
by the layers. Arms: `off`; `on` (the ask, CHUNK bytes a thread); `warm` (every layer the
same weights, which stay in L2: what reading o_proj from L2 alone would give). Prints the
machine, commit and settings, then us a layer per context and arm, and whether `on`'s
output equals `off`'s (the ask is a hint: the same bytes are read). Needs compute
capability 9.0 (the bulk prefetch).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record

ARMS = ("off", "on", "warm")


def layer_chain(shape: tuple[int, int, int, int], context: int, layers: int, arm: str,
                device: torch.device):
    """A function running the layers once (the arm's way), and its output tensor's maker."""
    import triton

    from strata.attention import triton_kernel
    from strata.attention.triton_paged import query_tiles, tiles_for
    from strata.layers import gemv_triton, l2_prefetch, norm_triton

    hidden, heads, kv_heads, head_dim = shape
    dtype, block_size = torch.bfloat16, 16
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen) * 0.02

    distinct = 1 if arm == "warm" else layers
    qkv = [rand(heads * head_dim + 2 * kv_heads * head_dim, hidden) for _ in range(distinct)]
    o_proj = [rand(hidden, heads * head_dim) for _ in range(distinct)]
    width = triton.cdiv(context, block_size)
    keys = [rand(width * block_size, kv_heads, head_dim) for _ in range(layers)]
    values = [rand(width * block_size, kv_heads, head_dim) for _ in range(layers)]
    norm = torch.ones(hidden, device=device, dtype=dtype)
    positions = torch.tensor([context - 1], dtype=torch.int32, device=device)
    tables = torch.arange(width, dtype=torch.int32, device=device)[None, :]
    tiles = torch.tensor(query_tiles([1], tiles_for(1, 1)), dtype=torch.int32, device=device)
    x0 = rand(1, hidden) * 50

    def run() -> torch.Tensor:
        l2_prefetch.enabled = arm == "on"
        x = x0
        for i in range(layers):
            w = i % distinct
            q = gemv_triton.gemv(norm_triton.rms_norm(x, norm, 1e-6), qkv[w])
            l2_prefetch.prefetch(o_proj[w])
            q = q[:, :heads * head_dim].view(1, heads, head_dim)
            out = triton_kernel.paged_attention(q, keys[i], values[i], positions, tables,
                                                tiles[0], tiles[1], tiles[2], block_size,
                                                head_dim ** -0.5)
            x = gemv_triton.gemv(out.view(1, heads * head_dim), o_proj[w])
        return x
    return run


def time_chain(run, layers: int, repeats: int) -> tuple[float, torch.Tensor]:
    """us a layer (the median of five timings of `repeats` graph replays) and the output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compiles every kernel before the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        graph.replay()
    timings = []
    for _ in range(5):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) * 1000 / repeats / layers)
    return statistics.median(timings), out.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", default="2048,32,4,128",
                        help="hidden,heads,kv heads,head dim (default: Qwen3-30B-A3B's)")
    parser.add_argument("--contexts", default="128,512,2048", help="keys attended to")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        print("l2_prefetch: error: give a --device of compute capability 9.0 or more (the "
              "bulk prefetch is Hopper's)", file=sys.stderr)
        return 2
    shape = tuple(int(n) for n in args.shape.split(","))
    contexts = [int(c) for c in args.contexts.split(",")]
    from strata.layers import l2_prefetch
    was = l2_prefetch.enabled
    rows, raw = [], {}
    try:
        for context in contexts:
            us, outs = {}, {}
            for arm in ARMS:
                us[arm], outs[arm] = time_chain(
                    layer_chain(shape, context, args.layers, arm, device), args.layers,
                    args.repeats)
            same = torch.equal(outs["on"], outs["off"])
            raw[context] = {**us, "same": same}
            rows.append([context] + [f"{us[arm]:.2f}" for arm in ARMS]
                        + [f"{us['off'] - us['on']:+.2f}", "yes" if same else "NO"])
    finally:
        l2_prefetch.enabled = was
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: shape {args.shape} "
          f"(hidden, heads, kv heads, head dim), bf16, {args.layers} layers, one token, "
          f"{args.repeats} replays x 5, ask {l2_prefetch.CHUNK} bytes a thread")
    print(markdown_table(["context", "off (us a layer)", "on", "warm", "saved", "on = off"],
                         rows))
    record(args, {"benchmark": "l2_prefetch", "settings": {
        "shape": args.shape, "layers": args.layers, "repeats": args.repeats,
        "chunk": l2_prefetch.CHUNK}, "us_per_layer": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
