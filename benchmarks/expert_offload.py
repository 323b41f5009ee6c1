"""MoE experts in host RAM behind a VRAM cache (--experts-in-ram): decode speed, hit rate
and PCIe bytes for cache sizes and routings.

    .venv/bin/python benchmarks/expert_offload.py --model random:qwen3-30b-a3b:q4_k \\
        --devices cuda:0 --quantized-weights on --caches 100,50,25

For each cache size (a share of the experts) one engine is built; a row "on device" (every
expert in VRAM, no --experts-in-ram) is the speed to reach. Each engine decodes 1 and 4
streams (plain decode: --spec 0 unless given) under two routings, labelled:

  own    the model's own router. Random weights route close to uniformly: the worst case.
  trace  a synthetic routing with the locality real models show, written over the routers'
         logits: each stream's next token keeps each of its previous token's experts per
         layer with probability --keep, draws a new one from the experts of its last
         --recent tokens with probability --reuse, else uniformly. The defaults (0.5, 0.5,
         32) reproduce, on a 512-expert top-10 model, what a llama.cpp branch measured on
         one (a per-layer LRU of 64 experts hit ~67%, 128 ~81%; the 32 most used experts
         take ~10% of the routing: popularity is nearly flat, reuse is temporal):
         simulated 70% and 80%, 11% (`--fit` prints it). The prefetch's prediction of a
         layer's experts (--expert-prefetch: the next router applied one layer early)
         gets each of the trace's experts right with probability --predict, else a
         uniform wrong one: 0.85 by default, as speculative expert loading one layer
         ahead recalled 80-90% on Mixtral-8x7B (Eliseev & Mazur 2023, "Fast Inference of
         Mixture-of-Experts Language Models with Offloading"). Under the model's own
         routing the prediction is the real one.

Arms: `--caches 25,25:lfu:1:0` is a share of the experts, then optionally a policy, a
--pcie-frac and an --expert-prefetch (0: off).

Columns: decode tok/s per stream and in total; hit rate (distinct experts per window read
from VRAM, prefetched ones counted as hits); MiB per token over PCIe read by the kernels
(misses) and uploaded into the cache (prefetches included); upload seconds (admissions'
side stream) and how long the compute stream waited for them (exposed); the prefetch's
recall and the share of its uploads read; and the exposed cost: ms per token beyond the
"on device" row. `--record` appends the numbers to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.cli import add_engine_flags, engine_config
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.experts.cache import ExpertStats
from strata.layers.moe import SparseMoE
from strata.sampling.params import SamplingParams


class TraceRouting:
    """Routers' logits replaced, per window, by a synthetic trace's (or left alone):
    logits * keep + trace * use, with keep/use device scalars, so that CUDA graphs
    captured once serve both routings."""

    def __init__(self, top_k: int, keep: float, reuse: float, recent: int, seed: int = 0):
        self.top_k, self.keep_p, self.reuse, self.recent = top_k, keep, reuse, recent
        self.rng = np.random.default_rng(seed)
        self.gates: dict[int, int] = {}  # id(router) -> MoE layer order
        self.buffer: torch.Tensor | None = None
        self.mix: torch.Tensor | None = None  # [2]: (keep, use)
        self.state: dict[tuple[int, int], tuple[list[int], deque]] = {}
        self.trace: np.ndarray | None = None
        self.on, self.step = False, 0
        self.predict_p = 0.85
        self.predicting = False  # a router called by the prefetch (predict_experts)
        self.guess: torch.Tensor | None = None  # its logits under the trace

    def install(self, max_tokens: int) -> None:
        """A forward hook on every router built from now on."""
        original = SparseMoE.__init__
        routing = self

        def init(module, *args, **kwargs):
            original(module, *args, **kwargs)
            module.gate.register_forward_hook(routing._hook)

        SparseMoE.__init__ = init
        predict = SparseMoE.predict_experts

        def predicting(module, x):
            self.predicting = True
            try:
                return predict(module, x)
            finally:
                self.predicting = False

        SparseMoE.predict_experts = predicting
        self.max_tokens = max_tokens

    def _hook(self, gate, args, logits):
        index = self.gates.setdefault(id(gate), len(self.gates))
        if self.buffer is None or index >= self.buffer.shape[0]:
            rows = max(64, 2 * index + 2)
            old = self.buffer
            self.buffer = torch.zeros(rows, self.max_tokens, logits.shape[1],
                                      dtype=logits.dtype, device=logits.device)
            self.guess = torch.zeros_like(self.buffer)
            if old is not None:
                self.buffer[:old.shape[0]] = old
            if self.mix is None:
                self.mix = torch.tensor([1.0, 0.0], dtype=logits.dtype, device=logits.device)
        tokens = logits.shape[0]
        trace = self.guess if self.predicting else self.buffer
        return logits * self.mix[0] + trace[index, :tokens] * self.mix[1]

    def use(self, on: bool) -> None:
        self.on, self.step = on, 0
        self.prompt_rng = np.random.default_rng(7)  # the prompts' rows: the same each run
        if self.mix is not None:
            with torch.inference_mode():  # the buffers were made there
                self.mix.copy_(torch.tensor([0.0, 1.0] if on else [1.0, 0.0]))

    def prepare(self, streams: int = 4, steps: int = 512) -> None:
        """Each of `streams` streams' experts per MoE layer for `steps` tokens, drawn
        ahead (the same trace for every engine)."""
        layers, experts = len(self.gates), self.buffer.shape[2]
        self.state.clear()
        self.trace = np.array([[[self.next_experts(layer, row, experts)
                                 for _ in range(steps)] for row in range(streams)]
                               for layer in range(layers)])  # [L, streams, steps, k]

    def advance(self, num_tokens: int) -> None:
        """The next window's logits: row r of a window continues stream r (rows past
        the streams, prompt tokens, route uniformly)."""
        if not self.on:
            return
        layers, streams, steps, top_k = self.trace.shape
        experts = self.buffer.shape[2]
        tokens = min(num_tokens, self.max_tokens)
        chosen = self.prompt_rng.random((layers, tokens, experts)).argsort(axis=2)[..., :top_k]
        known = min(tokens, streams)
        chosen[:, :known] = self.trace[:, :known, self.step % steps]
        self.step += 1
        # the prefetch's guess: each expert right with probability predict_p, else another
        wrong = self.prompt_rng.random((layers, tokens, top_k)) >= self.predict_p
        guessed = np.where(wrong, self.prompt_rng.integers(0, experts, chosen.shape), chosen)
        # NOTE: from pageable memory: staged at once, in stream order with the windows
        with torch.inference_mode():
            for target, picked in ((self.buffer, chosen), (self.guess, guessed)):
                logits = np.zeros((layers, tokens, experts), dtype=np.float32)
                np.put_along_axis(logits, picked, 10.0 - 0.01 * np.arange(top_k), axis=2)
                target[:layers, :tokens].copy_(torch.from_numpy(logits), non_blocking=True)

    def next_experts(self, layer: int, row: int, experts: int) -> list[int]:
        previous, history = self.state.get((layer, row), ([], deque(maxlen=self.recent)))
        rng = self.rng
        chosen = [e for e in previous if rng.random() < self.keep_p]
        seen = set(chosen)
        recent = [e for step in history for e in step]
        while len(chosen) < self.top_k:
            e = (recent[rng.integers(len(recent))] if recent and rng.random() < self.reuse
                 else int(rng.integers(experts)))
            if e not in seen:
                seen.add(e)
                chosen.append(e)
        history.append(chosen)
        self.state[(layer, row)] = (chosen, history)
        return chosen


def fit(routing: TraceRouting) -> str:
    """The trace on a 512-expert top-10 layer: LRU hit rates at 64 and 128 slots and the
    share of the 32 most used experts (what the defaults were fitted to)."""
    probe = TraceRouting(10, routing.keep_p, routing.reuse, routing.recent, seed=1)
    steps = [probe.next_experts(0, 0, 512) for _ in range(3000)]
    out = []
    for slots in (64, 128):
        cache, hits, reads = {}, 0, 0
        for t, step in enumerate(steps):
            for e in step:
                reads += 1
                hits += e in cache
                cache[e] = t
                if len(cache) > slots:
                    del cache[min(cache, key=cache.get)]
        out.append(f"LRU {slots} slots {100 * hits / reads:.0f}%")
    counts = np.bincount(np.concatenate(steps), minlength=512)
    out.append(f"top-32 share {100 * np.sort(counts)[::-1][:32].sum() / counts.sum():.0f}%")
    return ", ".join(out)


def decode(engine: Engine, routing: TraceRouting, users: int, tokens: int,
           seed: int) -> tuple[float, ExpertStats, int, list]:
    """(decode seconds, expert stats during decode, tokens decoded, the streams' tokens)
    of `users` greedy streams."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    requests = [engine.add_request(torch.randint(0, vocab, (32,), generator=gen).tolist(),
                                   SamplingParams(temperature=0, max_tokens=tokens,
                                                  ignore_eos=True))
                for _ in range(users)]
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    before = [ExpertStats(*s.vector()) for s in engine.expert_stats]
    first = sum(r.num_output_tokens for r in requests)
    start = time.perf_counter()
    while not all(r.finished for r in requests):
        engine.step()
    seconds = time.perf_counter() - start
    stats = ExpertStats()
    for now, then in zip(engine.expert_stats, before):
        stats.add([a - b for a, b in zip(now.vector(), then.vector())])
    return (seconds, stats, sum(r.num_output_tokens for r in requests) - first,
            [list(r.output_ids) for r in requests])


def cpu_expert_cost(bandwidth: float, threads: int) -> str:
    """One expert of Qwen3-30B-A3B's shape computed on the CPU (what llama.cpp's
    --n-cpu-moe does for a miss), as PyTorch does it (a quantized expert dequantized
    first, then three products), against reading its bytes over PCIe."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_moe_triton_quant import quantized_experts

    from strata.quant import dequantize
    torch.set_num_threads(threads)
    blocks = [(b[0], q) for b, q in quantized_experts(("Q4_K", "Q4_K", "Q6_K"), 1, 2048, 768)]
    dense = [dequantize(b, q, torch.bfloat16) for b, q in blocks]
    rows = []
    arms = (("Q4_K/Q4_K/Q6_K, dequantized per use", sum(b.nbytes for b, _ in blocks),
             lambda: [dequantize(b, q, torch.bfloat16) for b, q in blocks]),
            ("bf16", sum(w.nbytes for w in dense), lambda: dense))
    for label, size, weights in arms:
        for w in (1, 4):
            x = torch.randn(w, 2048, dtype=torch.bfloat16)

            def compute():
                gate, up, down = weights()
                return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

            compute()
            start = time.perf_counter()
            for _ in range(5):
                compute()
            ms = (time.perf_counter() - start) / 5 * 1e3
            rows.append([label, str(w), f"{ms:.2f}", f"{size / bandwidth / 1e6:.3f}",
                         f"{size / 2**20:.1f}"])
    return markdown_table(["expert", "tokens", f"CPU ms ({threads} threads)",
                           f"PCIe ms at {bandwidth:.1f} GB/s", "MiB"], rows)


def mib(size: float) -> str:
    return f"{size / 2**20:.0f}" if size >= 10 * 2**20 else f"{size / 2**20:.2f}"


def pcie_bandwidth(device: torch.device) -> float:
    """GB/s of a 1 GiB pinned host-to-device copy."""
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * 2**30 / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--caches", default="100,75,50,25",
                        help="cache arms, comma-separated: %% of the experts, optionally "
                        "with a policy, a --pcie-frac and an --expert-prefetch "
                        "(25:lfu, 25:lru:0.25, 25:lfu:1:0)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the row with every expert on the device")
    parser.add_argument("--users", default="1,4")
    parser.add_argument("--tokens", type=int, default=96, help="decode tokens per stream")
    parser.add_argument("--routings", default="own,trace")
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--reuse", type=float, default=0.5)
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--predict", type=float, default=0.85,
                        help="trace: the prefetch's chance to predict each expert right")
    parser.add_argument("--fit", action="store_true", help="print the trace's fit and exit")
    parser.add_argument("--cpu-experts", action="store_true",
                        help="time one expert computed on the CPU against its bytes over "
                        "PCIe (52 GB/s where no CUDA device is named) and exit")
    add_record_flags(parser)
    add_engine_flags(parser, defaults={"spec": 0, "parallel": 4})
    args = parser.parse_args()
    users = [int(u) for u in args.users.split(",")]
    routings = args.routings.split(",")
    base = engine_config(args)
    routing = TraceRouting(0, args.keep, args.reuse, args.recent)
    routing.predict_p = args.predict
    if args.fit:
        print(fit(routing))
        return 0
    if args.cpu_experts:
        device = torch.device(base.devices[0])
        bandwidth = pcie_bandwidth(device) if device.type == "cuda" else 52.0
        print(f"machine: {machine()}\ncommit: {commit()}\n")
        print(cpu_expert_cost(bandwidth, os.cpu_count() or 1))
        return 0
    routing.install(max(base.max_window_tokens, base.cuda_graph_max_tokens))
    arms = [] if args.no_baseline else [("on device", {"experts_in_ram": "off"})]
    for arm in args.caches.split(","):
        share, *rest = arm.split(":")
        overrides = {"experts_in_ram": "on", "expert_cache": f"{share}%"}
        if rest:
            overrides["expert_cache_policy"] = rest[0]
        if len(rest) > 1:
            overrides["pcie_frac"] = float(rest[1])
        if len(rest) > 2:
            overrides["expert_prefetch"] = int(rest[2])
        arms.append((f"{share}%" + "".join(f" {r}" for r in rest), overrides))
    device = torch.device(base.devices[0])
    bandwidth = pcie_bandwidth(device) if device.type == "cuda" else float("nan")
    rows, raw, reference, repeats = [], [], {}, []
    for label, overrides in arms:
        try:
            config = dataclasses.replace(base, **overrides)
            routing.gates.clear()  # this engine's routers, numbered again in layer order
            engine = Engine(config)
        except StrataError as e:
            print(f"expert_offload: error: {e}", file=sys.stderr)
            return 2
        stage = engine.runner.stages[0]
        launch = stage.move_blocks

        def move_blocks(header, launch=launch):
            routing.advance(header.num_tokens)
            launch(header)

        stage.move_blocks = move_blocks
        held = stage.experts.pool_bytes / 2**30 if stage.experts is not None else 0.0
        routing.use(False)
        decode(engine, routing, 1, 4, seed=99)  # warm-up (the routers are seen)
        if routing.trace is None and "trace" in routings:
            routing.top_k = engine.model_config.num_experts_per_tok
            routing.prepare(max(users))
        for name in routings:
            routing.use(name == "trace")
            for n in users:
                routing.use(name == "trace")
                seconds, stats, tokens, outputs = decode(engine, routing, n, args.tokens,
                                                         seed=n)
                per_token = seconds / max(tokens, 1)
                key = (name, n)
                if label == "on device":
                    reference[key] = (per_token, outputs)
                    routing.use(name == "trace")  # the same trace again
                    again = decode(engine, routing, n, args.tokens, seed=n)[3]
                    repeats.append(f"{name}/{n}: {'yes' if again == outputs else 'NO'}")
                exposed = ((per_token - reference[key][0]) * 1e3 if key in reference
                           else None)
                same = ("-" if key not in reference or label == "on device" else
                        "yes" if outputs == reference[key][1] else "NO")
                reads = stats.hits + stats.misses
                rows.append([
                    label, name, n, f"{tokens / seconds / n:.1f}", f"{tokens / seconds:.1f}",
                    f"{100 * stats.hit_rate:.1f}%" if reads else "-",
                    mib(stats.read_bytes / max(tokens, 1)) if reads else "-",
                    mib(stats.upload_bytes / max(tokens, 1)) if reads else "-",
                    f"{stats.upload_seconds:.2f}" if reads else "-",
                    f"{stats.exposed_seconds:.2f}" if reads else "-",
                    f"{100 * stats.recall:.0f}%" if stats.recall is not None else "-",
                    (f"{100 * stats.prefetch_used / stats.prefetched:.0f}%"
                     if stats.prefetched else "-"),
                    f"{exposed:.1f}" if exposed is not None and label != "on device" else "-",
                    same, f"{held:.1f}"])
                raw.append({"cache": label, "routing": name, "users": n, "tokens": tokens,
                            "same_tokens": same,
                            "seconds": seconds, "stats": stats.vector(), "vram_gib": held})
        engine.close()
        del engine, stage
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model = args.model or "default"
    settings = (f"devices={','.join(base.devices)} dtype={base.torch_dtype()} "
                f"quantized_weights={base.quantized_weights} spec={base.spec} "
                f"policy={base.expert_cache_policy} pcie_frac={base.pcie_frac} "
                f"expert_prefetch={base.expert_prefetch} "
                f"cuda_graphs={base.cuda_graphs}")
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: {settings}")
    print(f"pinned host-to-device copy: {bandwidth:.1f} GB/s; trace: keep {args.keep}, "
          f"reuse {args.reuse} of the last {args.recent} tokens ({fit(routing)}), "
          f"prefetch guesses right {args.predict}\n")
    if repeats:
        print("on device, the same tokens when run again: " + ", ".join(repeats) + "\n")
    print(markdown_table(
        ["experts in VRAM", "routing", "streams", "tok/s per stream", "tok/s total",
         "hit rate", "MiB/token read over PCIe", "MiB/token uploaded", "upload s (side stream)",
         "upload s exposed",
         "prefetch recall", "prefetched read",
         "exposed ms/token", "same tokens as on device", "expert cache GiB"], rows))
    record(args, {"benchmark": "expert_offload", "model": model, "settings": settings,
                  "pcie_gb_s": bandwidth, "runs": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
