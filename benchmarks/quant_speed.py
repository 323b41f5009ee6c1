"""Quantized matmul kernels against a dense bf16 matmul: microseconds per call and the
weight bytes read per second, per GGUF format and window width.

    .venv/bin/python benchmarks/quant_speed.py --device cuda:0
    .venv/bin/python benchmarks/quant_speed.py --device cuda:0 --shape 2048x6144 --widths 1,32

Weights are random block bytes with finite scales (strata/weights/random_checkpoint.py).
Each call is timed as a CUDA graph replay (launches excluded), median of --repeats
(strata/bench/timing.py). Widths
up to 32 take the GEMV kernel (`strata.quant.matmul`); larger ones the dequantize kernel
and one GEMM. GB/s counts the weight's bytes once per call.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.timing import median_seconds
from strata.quant import FORMATS, matmul
from strata.weights.random_checkpoint import RandomCheckpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", default="4096x4096", help="OUTxIN of the weight")
    parser.add_argument("--widths", default="1,4,16,32,256", help="tokens per call")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        print("quant_speed: error: give a CUDA --device (the kernels are Triton's)",
              file=sys.stderr)
        return 2
    out, inp = (int(v) for v in args.shape.lower().split("x"))
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    dense = torch.empty(out, inp, dtype=torch.bfloat16, device=device).normal_(0, 0.02,
                                                                               generator=gen)
    xs = {w: torch.randn(w, inp, dtype=torch.bfloat16, device=device, generator=gen)
          for w in widths}
    rows, raw = [], {}
    with torch.inference_mode():
        cells = [median_seconds(lambda w=w: F.linear(xs[w], dense), device, args.repeats)
                 for w in widths]
        size = dense.numel() * 2
        rows.append(["bf16", f"{size / 2**20:.1f}"]
                    + [f"{t * 1e6:.1f} / {size / t / 1e9:.0f}" for t in cells])
        raw["bf16"] = cells
        for name in args.formats.split(","):
            blocks = RandomCheckpoint(f"qwen3-30b-a3b:{name}").blocks("w", (out, inp), device)
            if blocks is None:
                continue  # rows not whole blocks of this format
            size = blocks.numel()
            cells = [median_seconds(lambda w=w: matmul(xs[w], blocks, name), device, args.repeats)
                     for w in widths]
            rows.append([name, f"{size / 2**20:.1f}"]
                        + [f"{t * 1e6:.1f} / {size / t / 1e9:.0f}" for t in cells])
            raw[name] = cells
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: weight {out}x{inp} "
          f"x bf16, device={device}, repeats={args.repeats} (median of CUDA graph replays)")
    print(markdown_table(["format", "weight MiB"] + [f"w={w}: us / GB/s" for w in widths],
                         rows))
    record(args, {"benchmark": "quant_speed", "settings": {
        "shape": [out, inp], "device": str(device), "widths": widths}, "seconds": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
