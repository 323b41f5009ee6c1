"""Dense projections of decode and verify windows: Strata's Triton kernels
(strata/layers/gemv_triton.py: the GEMV of 1-4 tokens, the GEMM of 5-64) against cuBLAS,
microseconds per call, per weight shape and window width, on a GPU.

    .venv/bin/python benchmarks/linear_speed.py --device cuda:0
    .venv/bin/python benchmarks/linear_speed.py --device cuda:0 --shapes 5120x2048 --widths 1,8

Each call is timed as a layer runs it: after the RMSNorm kernel that feeds it
(norm_triton, a programmatic dependent launch), in a CUDA graph of pairs (norm,
projection) whose weights rotate over enough copies that none stays in L2 (a model reads
each weight once a window); the norms' own time, timed the same way alone, is taken off.
So a cell is what the projection adds to a window, its start and end overlapped with its
neighbours or not. `*` marks the kernel `--layer-kernels triton` runs by default
(gemv_triton.takes). A gated down projection (a gated MLP's: its input is gate and up)
is timed against silu_mul's kernel then cuBLAS. `--splits 1,2,4,8` adds a table of the
GEMM's windows (more than 4 tokens) with its columns walked in each number of splits,
`*` the split count it takes by default (gemv_triton.gemm_splits).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.timing import median_seconds

# (name, rows, row length) of each dense projection of a decoding window; a name ending
# in "gated" takes gate and up (2 x the row length) as its input
MODELS = {
    "smollm2-135m": [("qkv", 960, 576), ("o_proj", 576, 576), ("gate_up", 3072, 576),
                     ("down", 576, 1536), ("down gated", 576, 1536),
                     ("lm_head", 49152, 576)],
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("lm_head", 151936, 2048)],
}
L2_BYTES = 400 << 20  # weight copies per cell: at least this much (H200's L2: 50 MiB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"whose projection shapes to time ({', '.join(MODELS)})")
    parser.add_argument("--shapes", default="", help="OUTxIN,... instead of --models'")
    parser.add_argument("--widths", default="1,2,4,8,16,36", help="tokens per call")
    parser.add_argument("--splits", default="",
                        help="split counts of the GEMM's columns to time too (1,2,4,8)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        print("linear_speed: error: give a CUDA --device (the kernels are Triton's)",
              file=sys.stderr)
        return 2
    from strata.layers import gemv_triton, norm_triton
    from strata.layers.fused import silu_mul
    try:
        shapes = ([(s, *(int(v) for v in s.lower().split("x"))) for s in args.shapes.split(",")]
                  if args.shapes else [(f"{m} {name}", rows, cols) for m in args.models.split(",")
                                       for name, rows, cols in MODELS[m]])
        widths = [int(w) for w in args.widths.split(",")]
        splits = [int(c) for c in args.splits.split(",") if c]
    except (KeyError, ValueError) as e:
        print(f"linear_speed: error: --models takes {', '.join(MODELS)}, --shapes OUTxIN,... "
              f"and --widths integers ({e})", file=sys.stderr)
        return 2
    gen = torch.Generator(device=device).manual_seed(0)
    table, split_table, raw = [], [], {}
    with torch.inference_mode():
        for name, rows, cols in shapes:
            gated = name.endswith("gated")
            copies = max(2, min(8, -(-L2_BYTES // (rows * cols * 2))))
            weights = [torch.empty(rows, cols, dtype=torch.bfloat16, device=device).normal_(
                0, 0.02, generator=gen) for _ in range(copies)]
            norm_weight = torch.ones(2 * cols if gated else cols, dtype=torch.bfloat16,
                                     device=device)
            cells, raw[name] = [], {}
            for width in widths:
                x = torch.randn(width, 2 * cols if gated else cols, dtype=torch.bfloat16,
                                device=device, generator=gen)

                def timed(project=None) -> float:
                    turn = itertools.cycle(weights)  # each captured call its own copy

                    def pair():
                        normed = norm_triton.rms_norm(x, norm_weight, 1e-6)
                        if project is not None:
                            project(normed, next(turn))
                    return median_seconds(pair, device, args.repeats, per_graph=4 * copies)

                alone = timed()
                cublas = timed((lambda a, w: F.linear(silu_mul(a), w)) if gated
                               else F.linear) - alone
                fits = gemv_triton.fits(x[:, :cols], weights[0])
                ours = (timed(lambda a, w: gemv_triton.gemv(a, w, gated=gated)) - alone
                        if fits else None)
                taken = gemv_triton.takes(x, weights[0], gated)
                if fits and splits and width > gemv_triton.ROW_TOKENS:
                    default = gemv_triton.gemm_splits(rows, cols, gated)
                    by_split = {c: timed(lambda a, w, c=c: gemv_triton.gemv(
                        a, w, gated=gated, splits=c)) - alone for c in splits}
                    split_table.append([name, str(width)] + [
                        f"{t * 1e6:.1f}{'*' if c == default else ''}"
                        for c, t in by_split.items()])
                    raw[name][f"{width} by splits"] = by_split
                cells.append(f"{cublas * 1e6:.1f}{'' if taken else '*'} / " + (
                    "-" if ours is None else f"{ours * 1e6:.1f}{'*' if taken else ''}"))
                raw[name][width] = {"cublas": cublas, "strata": ours, "taken": taken}
            table.append([name, f"{rows}x{cols}", f"{rows * cols * 2 / 2**20:.1f}"] + cells)
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: bf16, device={device}, "
          f"repeats={args.repeats} (median of CUDA graph replays, after a norm kernel)")
    print(markdown_table(["weight", "shape", "MiB"]
                         + [f"w={w}: cuBLAS / Strata us" for w in widths], table))
    if split_table:
        print(markdown_table(["weight", "w"] + [f"{c} splits, us" for c in splits],
                             split_table))
    record(args, {"benchmark": "linear_speed", "settings": {
        "device": str(device), "widths": widths, "splits": splits}, "seconds": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
