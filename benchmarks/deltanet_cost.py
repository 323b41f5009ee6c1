"""C(w) of one Gated DeltaNet layer (Qwen3-Next's linear attention, layers/deltanet.py)
for verify windows of w = 1..9 tokens (the last token and w - 1 drafts, each kept token's
state written to its row) and for prompt chunks, against one token — the DeltaNet's share
of what a draft costs a hybrid model (the full-attention and MoE layers are the other
benchmarks' business: window_speed.py and moe_cost.py).

    .venv/bin/python benchmarks/deltanet_cost.py --device cuda:0
    .venv/bin/python benchmarks/deltanet_cost.py --device cpu --paths reference

The layer has the preset's shape (random weights; speed does not depend on the values),
`--slots` entries per window, each with its own state rows. Paths: `reference` (the token
loop in PyTorch) and `triton` (the convolution and the delta rule as two kernels over the
window; CUDA, or anywhere under TRITON_INTERPRET=1). On CUDA the triton path is replayed
from a CUDA graph, as in a captured stage (launches not counted); the reference path
(host reads) runs eagerly with a device sync around each window.
"""

from __future__ import annotations

import argparse
import sys

import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.timing import median_seconds, random_weights
from strata.kvcache.cache import SlotStateCache
from strata.layers.deltanet import GatedDeltaNet, state_spec
from strata.layers.forward_meta import ForwardMeta
from strata.layers.linear import LinearFactory, WeightFormat
from strata.layers.state_meta import StateMeta
from strata.weights.random_checkpoint import PRESETS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def layer(preset: dict, device: torch.device, dtype: torch.dtype) -> GatedDeltaNet:
    module = GatedDeltaNet(preset["hidden_size"], preset["linear_num_key_heads"],
                           preset["linear_num_value_heads"], preset["linear_key_head_dim"],
                           preset["linear_value_head_dim"], preset["linear_conv_kernel_dim"],
                           preset["rms_norm_eps"], LinearFactory(WeightFormat(dtype)))
    return random_weights(module, device, dtype)


def window(slots: int, width: int, drafts: int, rows: int, device) -> ForwardMeta:
    """`slots` entries of `width` tokens at position 100 (not fresh), the last `drafts` of
    each drafts; entry e reads row e * rows and writes its next ones."""
    state = StateMeta.build((width,) * slots, (100,) * slots, (drafts,) * slots,
                            torch.arange(slots * rows).view(slots, rows))
    return ForwardMeta(
        positions=torch.arange(100, 100 + width, device=device).repeat(slots),
        logits_idx=torch.zeros(0, dtype=torch.long, device=device),
        backend=None, attention=None, state=state.to(device))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_flags(parser)
    parser.add_argument("--preset", default="qwen3-next-80b-a3b",
                        choices=[n for n, p in PRESETS.items() if "layer_types" in p])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--slots", type=int, default=1, help="entries per window")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9", help="verify window widths")
    parser.add_argument("--prompt", type=int, default=512, help="prompt chunk to time (0: none)")
    parser.add_argument("--paths", default="reference,triton")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    preset = PRESETS[args.preset]
    module = layer(preset, device, dtype)
    widths = [int(w) for w in args.widths.split(",")]
    rows = 2 + max(widths)
    spec = state_spec(preset["linear_num_key_heads"], preset["linear_num_value_heads"],
                      preset["linear_key_head_dim"], preset["linear_value_head_dim"],
                      preset["linear_conv_kernel_dim"])
    cache = SlotStateCache(spec, args.slots * rows, device)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    gen = torch.Generator(device=device).manual_seed(1)
    cases = [(f"verify w={w}", w, w - 1) for w in widths]
    if args.prompt:
        cases.append((f"prompt {args.prompt}", args.prompt, 0))
    rows_out, raw = [], {}
    with torch.inference_mode():
        for label, width, drafts in cases:
            x = torch.randn(args.slots * width, preset["hidden_size"], dtype=dtype,
                            device=device, generator=gen)
            meta = window(args.slots, width, drafts, rows, device)
            ms = {}
            for path in paths:
                module.path = path
                ms[path] = 1e3 * median_seconds(lambda: module(x, meta, cache), device,
                                                args.repeats, eager=path == "reference")
            raw[label] = ms
            rows_out.append([label] + [f"{ms[p]:.3f}" for p in paths])
    one = raw[f"verify w={widths[0]}"]
    for row, (label, *_) in zip(rows_out, cases):
        row += [f"{raw[label][p] / one[p]:.2f}" for p in paths]
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: preset={args.preset} "
          f"slots={args.slots} dtype={args.dtype} device={device} repeats={args.repeats} "
          f"(median; triton: CUDA graph replays, reference: eager, synced)")
    print(markdown_table(["window"] + [f"{p} ms" for p in paths]
                         + [f"{p} / w={widths[0]}" for p in paths], rows_out))
    record(args, {"benchmark": "deltanet_cost", "settings": {
        "preset": args.preset, "slots": args.slots, "dtype": args.dtype,
        "device": str(device)}, "ms": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
