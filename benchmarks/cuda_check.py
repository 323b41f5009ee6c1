"""Fidelity on a CUDA device (CI has no GPU, so this is run by hand on the GPU machine).

Builds tiny random llama, qwen3 and qwen3_moe checkpoints with transformers, then:
- fp32 on CUDA: Strata's logits against transformers on the CPU (relative max error);
- bf16 on CUDA: how often Strata's greedy tokens agree with fp32 transformers (bf16
  rounds differently, so this is measured and reported, not asserted);
- batched (8 requests, chunked prefill) against solo greedy tokens, both bf16 on CUDA;
- the triton attention backend against the reference backend (bf16 logits, max relative
  error), and greedy tokens replayed from CUDA graphs against eager ones (4 prompts x 256
  tokens, with drafts; and without drafts, graphs with windows built ahead against eager
  windows one at a time), on the tiny models and on `--gguf` (the default model) if given.

    python benchmarks/cuda_check.py --devices cuda:0 [--gguf model.gguf]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import build_tiny, prompts  # noqa: E402

from strata.bench.report import commit, machine, markdown_table  # noqa: E402
from strata.config import EngineConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--gguf", default=None, help="also check the fast path on this model")
    args = parser.parse_args()
    devices = tuple(args.devices.split(","))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "qwen3", "qwen3_moe"):
            folder = Path(tmp) / kind
            model = build_tiny(kind, folder)
            batch = prompts(8, model.config.vocab_size, seed=11, low=2, high=70)
            fp32 = Engine(EngineConfig(model=str(folder), devices=devices, dtype="fp32",
                                       max_context=128, layer_split=(2,)))
            errors = []
            for ids in batch[:3]:
                with torch.no_grad():
                    ref = model(torch.tensor([ids])).logits[0]
                ours = fp32.score(ids).float().cpu()
                errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
            ref_tokens = fp32.generate(batch, greedy)
            bf16 = Engine(EngineConfig(model=str(folder), devices=devices, dtype="bf16",
                                       max_context=128, parallel=3, max_window_tokens=16))
            solo = [bf16.generate([p], greedy)[0] for p in batch]
            batched = bf16.generate(batch, greedy)
            agree = sum(a == b for s, r in zip(solo, ref_tokens) for a, b in zip(s, r))
            same = sum(a == b for s, t in zip(solo, batched) for a, b in zip(s, t))
            total = sum(len(s) for s in solo)
            rows.append([kind, f"{max(errors):.1e}", f"{agree}/{total}", f"{same}/{total}"])
        fast = [fast_path(str(Path(tmp) / kind), devices) for kind in ("llama", "qwen3")]
    if args.gguf:
        fast.append(fast_path(args.gguf, devices))
    print(f"machine: {machine()}\ncommit: {commit()}\ndevices: {args.devices}\n")
    print(markdown_table(["model", "fp32 CUDA vs transformers: max rel. logit error",
                          "bf16 greedy tokens = fp32 greedy", "bf16 batched tokens = bf16 solo"],
                         rows))
    print()
    print(markdown_table(["model", "bf16 triton + compiled vs reference: max rel. logit error",
                          "greedy tokens, CUDA graphs = eager (4 x 256, drafts)",
                          "same, no drafts, graphs + windows ahead = eager one at a time"],
                         fast))
    return 0


def fast_path(model: str, devices: tuple[str, ...]) -> list[str]:
    """The triton backend's bf16 logits against the reference backend's; greedy tokens of
    graph replays against eager windows (both triton), with drafts."""
    common = dict(model=model, devices=devices, dtype="bf16", max_context=512, parallel=4)
    engines = {name: Engine(EngineConfig(**common, attention_backend=name, cuda_graphs="off",
                                         compile="off" if name == "reference" else "on"))
               for name in ("reference", "triton")}
    vocab = engines["reference"].model_config.vocab_size
    batch = prompts(4, vocab, seed=5, low=20, high=200)
    errors = []
    for ids in batch:
        ref = engines["reference"].score(ids).float()
        ours = engines["triton"].score(ids).float()
        errors.append(((ours - ref).abs().max() / ref.abs().max()).item())
    greedy = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    repetitive = [p[:12] * 4 for p in batch]  # so that drafts are made and accepted
    eager = engines["triton"].generate(repetitive, greedy)
    graphed = Engine(EngineConfig(**common, attention_backend="triton", cuda_graphs="on"))
    replayed = graphed.generate(repetitive, greedy)
    same = sum(a == b for e, r in zip(eager, replayed) for a, b in zip(e, r))
    # No drafts: graph replays of windows built ahead (tokens carried on the device)
    # against eager windows built one at a time.
    plain = Engine(EngineConfig(**common, attention_backend="triton", cuda_graphs="off",
                                spec=0, schedule_ahead="off")).generate(batch, greedy)
    ahead = Engine(EngineConfig(**common, attention_backend="triton", cuda_graphs="on",
                                spec=0)).generate(batch, greedy)
    carried = sum(a == b for e, r in zip(plain, ahead) for a, b in zip(e, r))
    total = sum(map(len, eager))
    return [Path(model).name, f"{max(errors):.1e}", f"{same}/{total}", f"{carried}/{total}"]


if __name__ == "__main__":
    sys.exit(main())
