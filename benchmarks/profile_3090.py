"""Write the cost profile of Strata's users' rig, derived rather than measured: 4 x RTX
3090 (936 GB/s each), PCIe 3.0 x8 between them, Qwen3-Next-80B-A3B (48 layers: 36 Gated
DeltaNet + 12 gated attention, 512 experts top-10 + a shared expert, hidden 2048) as
Unsloth's UD-Q4_K_XL GGUF, split 11,24,36 — so that `strata calibrate --simulate` can
predict their table without the hardware (docs/BATCHING.md shows the derivation).

    .venv/bin/python benchmarks/profile_3090.py                 # writes the profile below
    .venv/bin/strata calibrate --simulate benchmarks/profiles/rtx3090x4-qwen3-next-q4.json \\
        --acceptance code=0.85,edit=0.98,prose=0.64

A layer's time for a window of w tokens is a fixed cost per layer (its kernels' launches
and tails inside a CUDA graph) plus the bytes it reads at an effective bandwidth plus its
matmuls at an effective throughput. The bytes are the attention (or DeltaNet)
projections, the router and the shared expert, and the distinct routed experts the w
tokens touch: 512 (1 - (1 - 10/512)^w) of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.calibrate.profile import WIDTHS, CostProfile

BANDWIDTH = 936e9          # bytes/s, the RTX 3090's memory
EFFICIENCY = 0.65          # share of it that decode kernels reach (llama.cpp-class kernels)
FLOPS = 40e12              # effective fp16 tensor throughput of small dequantizing matmuls
LAYER_FIXED = 25e-6        # seconds per layer in a CUDA graph beyond its bytes
Q4 = 4.5 / 8               # bytes per weight of Q4_K (UD-Q4_K_XL keeps some tensors larger)
Q6 = 6.5625 / 8            # bytes per weight of Q6_K (the output layer)
HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH, VOCAB = 2048, 512, 10, 512, 151_936
DELTANET = HIDDEN * (2 * 16 * 128 + 2 * 32 * 128) + HIDDEN * 64 + 32 * 128 * HIDDEN
ATTENTION = HIDDEN * (16 * 256 * 2) + 2 * HIDDEN * 2 * 256 + 16 * 256 * HIDDEN
EXPERT = 3 * HIDDEN * EXPERT_WIDTH
ROUTER_BYTES = HIDDEN * EXPERTS * 2      # kept in 16 bits
HOP = 80e-6                # a hidden state across PCIe 3.0 x8 through host memory (no P2P)
HOST_WINDOW, HOST_TOKEN = 0.4e-3, 5e-6   # the engine's time per window (H200 host, measured)


def touched(w: int) -> float:
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** w)


def layer_seconds(w: int, attention: bool) -> float:
    own = ATTENTION if attention else DELTANET
    weights = own + EXPERT  # the shared expert
    nbytes = weights * Q4 + ROUTER_BYTES + touched(w) * EXPERT * Q4
    flops = 2 * w * (weights + TOP_K * EXPERT)
    return LAYER_FIXED + nbytes / (BANDWIDTH * EFFICIENCY) + flops / FLOPS


def head_seconds(w: int) -> float:
    """The final norm and lm_head over the w rows verified, and the MTP layer (an
    attention MoE layer and its input projection) drafting from them."""
    lm_head = VOCAB * HIDDEN
    fc = 2 * HIDDEN * HIDDEN
    nbytes = lm_head * Q6 + fc * Q4
    return (nbytes / (BANDWIDTH * EFFICIENCY) + 2 * w * (lm_head + fc) / FLOPS
            + layer_seconds(w, attention=True))


def profile(scale: float = 1.0) -> CostProfile:
    layers = tuple(tuple(scale * layer_seconds(w, attention=(i % 4 == 3)) for w in WIDTHS)
                   for i in range(48))
    return CostProfile(
        widths=WIDTHS, layers=layers, first=tuple(0.0 for _ in WIDTHS),
        last=tuple(scale * head_seconds(w) for w in WIDTHS),
        devices=tuple(f"cuda:{i}" for i in range(4)),
        hop_seconds=HOP, host_window_seconds=HOST_WINDOW, host_token_seconds=HOST_TOKEN,
        settings={"devices": tuple(f"cuda:{i}" for i in range(4)), "layer_split": (11, 24, 36),
                  "spec": 8},
        machine="4 x RTX 3090 (derived, not measured)",
        model="Qwen3-Next-80B-A3B UD-Q4_K_XL (48 layers)",
        note=f"derived by benchmarks/profile_3090.py: {EFFICIENCY:.0%} of {BANDWIDTH / 1e9:.0f} "
             f"GB/s, {FLOPS / 1e12:.0f} TFLOP/s, {LAYER_FIXED * 1e6:.0f} us per layer, hop "
             f"{HOP * 1e6:.0f} us, engine {HOST_WINDOW * 1e3:.1f} ms per window; layers and "
             f"head x {scale:.2f} so that one drafting group runs code at the users' "
             f"{ANCHOR:.0f} tok/s")


ANCHOR = 141.0  # tok/s the users measured for one request of code with one drafting group


def anchored() -> CostProfile:
    """The derived profile scaled so that the simulator's one drafting group (--spec 8,
    groups 1) decodes code (85% acceptance) at the users' measured rate."""
    from strata.calibrate.choose import synthetic
    from strata.calibrate.simulate import simulate
    from strata.config import EngineConfig
    config = EngineConfig(devices=tuple(f"cuda:{i}" for i in range(4)),
                          layer_split=(11, 24, 36), batch_groups=1, spec=8)
    traces = synthetic({"code": 0.85}, 2, 1024, 512)["code"]

    def rate(scale: float) -> float:
        runs = [simulate(profile(scale), config, [t], 0.85).streams[0].decode_tok_s
                for t in traces]
        return sum(runs) / len(runs)

    lo, hi = 0.2, 10.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if rate(mid) > ANCHOR else (lo, mid)
    return profile(round(hi, 3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "profiles"
                                             / "rtx3090x4-qwen3-next-q4.json"))
    args = parser.parse_args()
    p = anchored()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    p.save(args.out)
    stages = p.stage_costs((11, 24, 36))
    print(f"wrote {args.out}: {p.note}")
    for w in (1, 9, 17):
        print(f"w={w:2d}: stages {' '.join(f'{c(w) * 1e3:.2f}' for c in stages)} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
