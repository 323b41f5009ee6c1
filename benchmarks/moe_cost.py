"""C(w) of one MoE layer against its bytes-touched roofline: the input the cost model needs
for MoE stages (a draft token costs what the experts it routes to cost to read).

    .venv/bin/python benchmarks/moe_cost.py --device cuda:0                  # qwen3-30b-a3b
    .venv/bin/python benchmarks/moe_cost.py --device cuda:0 --experts 512 --top-k 10

One layer of the preset's shape (router, routed experts; random bf16 weights N(0, 0.02))
runs windows of w tokens of random hidden states. Per w it prints the distinct experts the
window touched, the bytes that must be read (distinct experts x one expert's gate, up and
down bytes, plus the router), the roofline time (those bytes at the device's bandwidth,
measured here by a device-to-device copy unless --bandwidth is given), each path's time
and its ratio to the roofline. Paths: `grouped` (tokens sorted by expert, one grouped
matrix product per projection: `torch._grouped_mm` on CUDA, a loop over experts elsewhere)
and `fused` (strata/layers/moe_triton.py: two Triton kernels reading only the routed
experts; CUDA, or anywhere under TRITON_INTERPRET=1), and `decoder`: the layer as a
decoder layer runs it, from the attention's output and the residual (`add_norm_forward`:
the post-attention add and norm too; on CUDA a 1-2 token window's norm, router logits
and choosing experts' kernels, `chose` in the settings line, which `fused` does not run).
On CUDA every path is timed as a
CUDA graph replay where it can be captured (launches and the replay's own ~14 us
excluded: one graph runs GRAPH_CALLS windows, each of its own random tokens, so that no
window finds its experts in the L2 cache), else eagerly. "experts touched" is the mean
over those windows.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.timing import GRAPH_CALLS, bandwidth, median_seconds, random_weights
from strata.layers.linear import LinearFactory, WeightFormat
from strata.layers.moe import SparseMoE
from strata.layers.norm import RMSNorm
from strata.weights.random_checkpoint import PRESETS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def moe_layer(args, device: torch.device, dtype: torch.dtype) -> SparseMoE:
    preset = PRESETS[args.preset]
    layer = SparseMoE(preset["hidden_size"], preset["moe_intermediate_size"],
                      args.experts or preset["num_experts"],
                      args.top_k or preset["num_experts_per_tok"], preset["norm_topk_prob"],
                      LinearFactory(WeightFormat(dtype)))
    return random_weights(layer, device, dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    parser.add_argument("--preset", default="qwen3-30b-a3b",
                        choices=[n for n, p in PRESETS.items() if "num_experts" in p])
    parser.add_argument("--experts", type=int, help="routed experts (default: the preset's)")
    parser.add_argument("--top-k", type=int, help="experts per token (default: the preset's)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--widths", default="1,2,4,8,16,32", help="window widths to time")
    parser.add_argument("--paths", default="grouped,fused,decoder",
                        help="of grouped, fused, decoder")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, help="device GB/s (default: measured)")
    parser.add_argument("--l2-prefetch", default="off", choices=("on", "off"),
                        help="a 1-2 token window's gate and up kernel asks its experts' down "
                             "weights into L2 (strata/layers/l2_prefetch.py; Hopper)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    widths = [int(w) for w in args.widths.split(",")]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := set(paths) - {"grouped", "fused", "decoder"}:
        print(f"moe_cost: error: --paths {', '.join(sorted(unknown))}: the paths are grouped, "
              "fused and decoder", file=sys.stderr)
        return 2
    if ("fused" in paths and device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):  # triton's own switch
        print("moe_cost: error: the fused path runs on CUDA, or on the CPU under "
              "TRITON_INTERPRET=1; or leave it out: --paths grouped,decoder", file=sys.stderr)
        return 2
    if device.type == "cuda":
        from strata.layers import l2_prefetch
        l2_prefetch.enabled = args.l2_prefetch == "on"
    layer = moe_layer(args, device, dtype)
    norm = RMSNorm(layer.gate.in_features, 1e-6).to(device, dtype)  # weight 1
    experts = layer.experts
    hidden, num_experts = experts.gate_proj.shape[2], experts.num_experts
    expert_bytes = sum(p[0].numel() * p.element_size()
                       for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    router_bytes = layer.gate.weight.numel() * layer.gate.weight.element_size()
    speed = args.bandwidth * 1e9 if args.bandwidth else bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(1)
    rows, raw, chose = [], {}, {}
    with torch.inference_mode():
        for w in widths:
            # GRAPH_CALLS windows, each its own tokens and experts (a graph replays them in
            # turn: no window finds another's experts in the L2 cache, as in a model).
            xs = [torch.randn(w, hidden, dtype=dtype, device=device, generator=gen)
                  for _ in range(GRAPH_CALLS)]
            touched = statistics.mean(
                int(torch.topk(torch.softmax(layer.gate(x).float(), dim=-1), layer.top_k,
                               dim=-1).indices.unique().numel()) for x in xs)
            need = touched * expert_bytes + router_bytes
            roof = need / speed
            seconds = {}
            for path in paths:
                experts.path = "auto" if path == "decoder" else path
                if path == "decoder":  # from the attention's output, a residual beside it
                    windows = itertools.cycle([(x, torch.randn_like(x)) for x in xs])
                    chose[w] = layer._router_chooses(xs[0], norm) is not None
                    step = lambda: layer.add_norm_forward(*next(windows), norm)  # noqa: E731
                else:
                    windows = itertools.cycle(xs)
                    step = lambda: layer(next(windows))  # noqa: E731
                seconds[path] = median_seconds(step, device, args.repeats)
            experts.path = "auto"
            raw[w] = {"touched": touched, "bytes": need, "roofline_s": roof, **seconds}
            rows.append([w, f"{touched:.1f}", f"{need / 2**20:.1f}", f"{roof * 1e6:.0f}"]
                        + [f"{seconds[p] * 1e6:.0f} / {seconds[p] / roof:.2f}x" for p in paths])
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: preset={args.preset} "
          f"experts={num_experts} top_k={layer.top_k} hidden={hidden} "
          f"expert_width={experts.gate_proj.shape[1]} dtype={args.dtype} device={device} "
          f"bandwidth={speed / 1e9:.0f} GB/s ({'given' if args.bandwidth else 'measured'}) "
          f"repeats={args.repeats} (median) l2_prefetch={args.l2_prefetch}"
          + (f" chose={','.join(str(w) for w in chose if chose[w]) or 'none'}" if chose else ""))
    print(markdown_table(["w", "experts touched", "MiB read", "roofline us"]
                         + [f"{p} us / roofline" for p in paths], rows))
    record(args, {"benchmark": "moe_cost", "settings": {
        "preset": args.preset, "experts": num_experts, "top_k": layer.top_k,
        "dtype": args.dtype, "device": str(device), "bandwidth": speed,
        "chose": [w for w in chose if chose[w]], "l2_prefetch": args.l2_prefetch},
        "widths": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
