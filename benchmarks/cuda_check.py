"""Fidelity on a CUDA device (CI has no GPU, so this is run by hand on the GPU machine).

Builds tiny random llama, qwen3, qwen3_moe and qwen3_next (hybrid: Gated DeltaNet
layers, whose state rolls back under drafts) checkpoints with transformers, then:
- fp32 on CUDA: Strata's logits against transformers on the CPU (relative max error);
- bf16 on CUDA: how often Strata's greedy tokens agree with fp32 transformers (bf16
  rounds differently, so this is measured and reported, not asserted);
- batched (8 requests, chunked prefill) against solo greedy tokens, both bf16 on CUDA;
- the triton attention backend with Strata's other Triton kernels (norms, rotation,
  projections) against the reference backend with PyTorch's (bf16 logits, max relative
  error), and greedy tokens replayed from CUDA graphs against eager ones (4 prompts x 256
  tokens, with drafts; and without drafts, graphs with windows built ahead against eager
  windows one at a time), on the tiny models and on `--gguf` (the default model) if given;
- quantized weights (strata/quant): each format's Triton kernels (GEMV for 1, 4 and 32
  tokens, dequantize + GEMM for 64; the row kernels of 1 and 4 tokens also walking an
  lm_head's many rows by blocks) against the PyTorch reference on the same device, and
  on `--gguf` the greedy tokens with projections kept quantized against dequantized bf16
  (4 prompts x 256 tokens);
- the fused MoE path against the grouped one (one layer of 8 experts top-2 and of 512
  experts top-10, 1 to 32 tokens, bf16); windows of one and two tokens whose experts'
  kernels take the top-k themselves against the route kernel's choice, bit for bit
  (dense bf16 experts, and Q4_K ones);
- experts in host RAM behind a VRAM cache (--experts-in-ram, 25% cached): the fused
  kernels (misses read from pinned host memory) bitwise against all experts on the
  device, bf16 and Q4_K, and greedy tokens of the tiny qwen3_moe (`--experts-only`: this
  check alone);
- prefix reuse on the device (fp32, CUDA graphs, drafts): an agent's second turn with the
  prefix cache off, on, and on with its blocks evicted to host RAM and copied back by
  the conversation cache (llama; qwen3_next, whose recurrent state comes from a state
  snapshot): greedy tokens against the run without reuse, and the tokens not computed.

    python benchmarks/cuda_check.py --devices cuda:0 [--gguf model.gguf]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import build_tiny, prompts  # noqa: E402
from test_qwen3_next import build_qwen3_next  # noqa: E402

from strata.bench.report import commit, machine, markdown_table  # noqa: E402
from strata.config import EngineConfig  # noqa: E402
from strata.engine.engine import Engine  # noqa: E402
from strata.layers.linear import Linear  # noqa: E402
from strata.layers.norm import RMSNorm  # noqa: E402
from strata.layers.rotary import RotaryEmbedding  # noqa: E402
from strata.sampling.params import SamplingParams  # noqa: E402

KINDS = ("llama", "qwen3", "qwen3_moe", "qwen3_next")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--gguf", default=None, help="also check the fast path on this model")
    parser.add_argument("--experts-only", action="store_true",
                        help="only the expert cache's checks (--experts-in-ram)")
    parser.add_argument("--l2-prefetch", default="off", choices=("on", "off"),
                        help="the fast path's engines with weights asked into L2 ahead "
                             "(strata/layers/l2_prefetch.py)")
    args = parser.parse_args()
    devices = tuple(args.devices.split(","))
    if args.experts_only:
        print(f"machine: {machine()}\ncommit: {commit()}\ndevices: {args.devices}\n")
        print(markdown_table(["experts in host RAM, 25% cached", "vs all on the device"],
                             expert_cache(devices)))
        return 0
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            folder = Path(tmp) / kind
            model = (build_qwen3_next(folder) if kind == "qwen3_next"
                     else build_tiny(kind, folder))
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
        fast = [fast_path(str(Path(tmp) / kind), devices, args.l2_prefetch) for kind in KINDS]
        reuse = [reuse_path(str(Path(tmp) / kind), devices) for kind in ("llama", "qwen3_next")]
    if args.gguf:
        fast.append(fast_path(args.gguf, devices, args.l2_prefetch))
    device = torch.device(devices[0])
    print(f"machine: {machine()}\ncommit: {commit()}\ndevices: {args.devices}, "
          f"--l2-prefetch {args.l2_prefetch} (the fast path)\n")
    print(markdown_table(["model", "fp32 CUDA vs transformers: max rel. logit error",
                          "bf16 greedy tokens = fp32 greedy", "bf16 batched tokens = bf16 solo"],
                         rows))
    print()
    print(markdown_table(["model", "bf16 triton + compiled vs PyTorch: max rel. logit error",
                          "greedy tokens, CUDA graphs = eager (4 x 256, drafts)",
                          "same, no drafts, graphs + windows ahead = eager one at a time"],
                         fast))
    print()
    print(markdown_table(["format", "bf16 kernels vs reference: max rel. error, w=1 / 4 / "
                          "32 / 64", "300 x 1024 walked", "lm_head-sized rows, by blocks: "
                          "w=1 / 4"], quant_kernels(device)))
    if args.gguf:
        print(f"\n{Path(args.gguf).name}: {quant_tokens(args.gguf, devices)}")
    print()
    print(markdown_table(["MoE layer", "fused vs grouped, bf16: max rel. error, w=1 / 4 / 32"],
                         moe_fused(device)))
    print()
    print(markdown_table(["MoE layer, 1 and 2 tokens", "experts chosen in the experts' kernels = "
                          "by the route kernel: outputs equal bit for bit"], moe_choice(device)))
    print()
    print(markdown_table(["model", "turn 2 greedy tokens = no reuse (fp32, graphs): cache on",
                          "evicted, from host RAM", "tokens not computed: on / host RAM"],
                         reuse))
    print()
    print(markdown_table(["experts in host RAM, 25% cached", "vs all on the device"],
                         expert_cache(devices)))
    return 0


def expert_cache(devices: tuple[str, ...]) -> list[list[str]]:
    """--experts-in-ram on the device: the fused kernels reading misses from pinned host
    memory (Qwen3-30B-A3B's expert shape, 16 experts, top-8, bf16 and Q4_K) against the
    same experts all on the device, and greedy tokens of the tiny qwen3_moe (bf16, CUDA
    graphs, drafts) with a quarter of its experts cached against all on the device."""
    from test_moe_triton import grouped_experts, routing, window
    from test_moe_triton_quant import keep_quantized, quantized_experts

    from strata.experts.cache import ExpertCache
    from strata.layers.moe import GroupedExperts

    device = torch.device(devices[0])
    rows = []

    def quantized(seed: int) -> GroupedExperts:
        return keep_quantized(GroupedExperts(2048, 768, 16, quantized=True),
                              quantized_experts(("Q4_K", "Q4_K", "Q6_K"), 16, 2048, 768,
                                                seed=seed))

    for kind, make in (("bf16", lambda: grouped_experts(16, 2048, 768, torch.bfloat16)),
                       ("Q4_K/Q4_K/Q6_K", lambda: quantized(0))):
        plain, cached = make(), make()
        plain.path = cached.path = "auto"  # fused up to 32 tokens, grouped above
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = getattr(plain, name)
            moved = torch.nn.Parameter(w.data.to(device), requires_grad=False)
            if hasattr(w, "qtype"):
                moved.qtype = w.qtype
            setattr(plain, name, moved)
        cache = ExpertCache([cached], device, 4)
        equal, total = 0, 0
        with torch.inference_mode():
            for w in (1, 4, 32):
                x = window(w, 2048, torch.bfloat16, seed=w).to(device)
                experts, weights = routing(w, 8, 16, torch.bfloat16, seed=w)
                experts, weights = experts.to(device), weights.to(device)
                equal += torch.equal(plain(x, experts, weights), cached(x, experts, weights))
                total += 1
            x = window(64, 2048, torch.bfloat16, seed=64).to(device)
            experts, weights = routing(64, 8, 16, torch.bfloat16, seed=64)
            experts, weights = experts.to(device), weights.to(device)
            ref = plain(x, experts, weights)
            grouped_err = rel(cached(x, experts, weights), ref)
            again = rel(plain(x, experts, weights), ref)
        rows.append([f"fused kernels, {kind}, w = 1, 4, 32 (bitwise)", f"{equal}/{total}"])
        rows.append([f"grouped path, {kind}, w = 64 (max rel. error; all on the device run "
                     "twice)", f"{grouped_err:.1e} ({again:.1e})"])
        del cache
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny("qwen3_moe", Path(tmp))
        batch = prompts(4, model.config.vocab_size, seed=5, low=8, high=60)
        batch = [p + p[:20] for p in batch]  # some drafts are right
        runs = {}
        ram = dict(experts_in_ram="on", expert_cache="25%")
        for label, extra in (("device", {}), ("prefetch 8", dict(ram, expert_prefetch=8)),
                             ("no prefetch", dict(ram, expert_prefetch=0))):
            engine = Engine(EngineConfig(model=tmp, devices=devices, dtype="bf16",
                                         max_context=256, parallel=4, spec=6,
                                         cuda_graphs="on", **extra))
            runs[label] = (engine.generate(batch, greedy), engine.generate(batch[:1], greedy),
                           engine.expert_stats[0])
        for label in ("prefetch 8", "no prefetch"):
            same = sum(a == b for s, t in zip(runs["device"][0], runs[label][0])
                       for a, b in zip(s, t))
            solo = sum(a == b for a, b in zip(runs["device"][1][0], runs[label][1][0]))
            stats = runs[label][2]
            ahead = (f", recall {100 * stats.recall:.0f}%, {stats.prefetched:.0f} prefetched "
                     f"({stats.prefetch_used:.0f} read)" if stats.recall is not None else "")
            rows.append([f"tiny qwen3_moe greedy tokens (bf16, CUDA graphs, drafts, {label}), "
                         "4 requests / 1",
                         f"{same}/{4 * 64} / {solo}/64 (hit rate {100 * stats.hit_rate:.0f}%, "
                         f"{stats.misses:.0f} misses read from host RAM{ahead})"])
    return rows


def reuse_path(model: str, devices: tuple[str, ...]) -> list[str]:
    """An agent's two turns (the second prompt: the first, its answer, new tokens) with
    the prefix cache off, on, and on with a pool of one context that another prompt
    empties between the turns (the conversation cache copies the blocks back)."""
    common = dict(model=model, devices=devices, dtype="fp32", max_context=512, parallel=2,
                  cuda_graphs="on")
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    vocab = Engine(EngineConfig(**common, spec=0)).model_config.vocab_size
    first = prompts(1, vocab, seed=3, low=40, high=41)[0] * 3
    other = prompts(1, vocab, seed=4, low=400, high=401)[0]
    out = {}
    evicted = dict(kv_tokens=512, conversation_cache_mib=64, state_snapshots=4)
    for arm, extra in (("off", dict(prefix_cache="off")), ("on", {}), ("host", evicted)):
        engine = Engine(EngineConfig(**common, **extra))
        answer = engine.generate([first], greedy)[0]
        if arm == "host":
            engine.generate([other], SamplingParams(temperature=0, max_tokens=1))
        request = engine.add_request(first + answer + [1, 2, 3], greedy)
        while engine.has_work:
            engine.step()
        out[arm] = (answer, request.output_ids, request.num_cached_tokens)
    def same(arm: str) -> str:
        pairs = [(a, b) for x, y in zip(out[arm][:2], out["off"][:2]) for a, b in zip(x, y)]
        return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return [Path(model).name, same("on"), same("host"), f"{out['on'][2]} / {out['host'][2]}"]


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def quant_kernels(device: torch.device) -> list[list[str]]:
    """Per format: the kernels against the reference on a 300 x 1024 weight (w = 1..4 by
    rows as `row_walk` picks for it, 32 by groups, 64 dequantized), and the row kernels
    (w = 1, 4) on weights of as many rows as an lm_head has, which they walk by blocks."""
    from strata.quant import FORMATS, matmul, reference
    from strata.quant.triton_quant import BY_BLOCK, WIDE_MAX_ROWS, row_walk
    from strata.weights.random_checkpoint import RandomCheckpoint
    rows = []
    for name in FORMATS:
        errors = []
        for shape, widths in (((300, 1024), (1, 4, 32, 64)), ((WIDE_MAX_ROWS, 512), (1, 4))):
            blocks = RandomCheckpoint(f"qwen3-30b-a3b:{name}").blocks("w", shape, device)
            weight = reference.dequantize(blocks, name)
            for w in widths:
                x = torch.randn(w, shape[1], device=device).bfloat16()
                errors.append(rel(matmul(x, blocks, name), x.float() @ weight.T))
        per_row = 1024 // FORMATS[name].block_values
        walk = "by blocks" if row_walk(name, 300, per_row) == BY_BLOCK else "wide"
        rows.append([name, " / ".join(f"{e:.1e}" for e in errors[:4]), walk,
                     " / ".join(f"{e:.1e}" for e in errors[4:])])
    return rows


def quant_tokens(model: str, devices: tuple[str, ...]) -> str:
    """Greedy tokens with projections kept quantized vs dequantized to bf16 at load."""
    common = dict(model=model, devices=devices, dtype="bf16", max_context=512, parallel=4)
    kept = Engine(EngineConfig(**common, quantized_weights="on"))
    dense = Engine(EngineConfig(**common, quantized_weights="off"))
    batch = prompts(4, kept.model_config.vocab_size, seed=5, low=20, high=200)
    error = max(rel(kept.score(ids), dense.score(ids)) for ids in batch)
    greedy = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    a, b = kept.generate(batch, greedy), dense.generate(batch, greedy)
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
             for s, t in zip(a, b)]
    return (f"projections kept quantized vs dequantized bf16: max rel. logit error "
            f"{error:.1e}; greedy tokens equal {same}/{sum(map(len, a))} (4 x 256), first "
            f"difference at token {first}")


def random_moe(inter: int, experts: int, top_k: int, device: torch.device, seed: int):
    """(a bf16 SparseMoE of hidden size 256 with random weights on `device`, the generator
    that made them, for its inputs)."""
    from strata.layers.linear import LinearFactory, WeightFormat
    from strata.layers.moe import SparseMoE
    layer = SparseMoE(256, inter, experts, top_k, True,
                      LinearFactory(WeightFormat(torch.bfloat16)))
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in layer.parameters():
        p.data = torch.empty(p.shape, dtype=torch.bfloat16, device=device).normal_(
            0, 0.05, generator=gen)
    return layer, gen


def moe_fused(device: torch.device) -> list[list[str]]:
    rows = []
    for experts, top_k in ((8, 2), (512, 10)):
        layer, gen = random_moe(128, experts, top_k, device, seed=0)
        errors = []
        for w in (1, 4, 32):
            x = torch.randn(w, 256, device=device, generator=gen).bfloat16()
            with torch.inference_mode():
                layer.experts.path = "fused"
                fused = layer(x)
                layer.experts.path = "grouped"
                grouped = layer(x)
            errors.append(rel(fused, grouped))
        rows.append([f"{experts} experts, top-{top_k}", " / ".join(f"{e:.1e}" for e in errors)])
    return rows


def moe_choice(device: torch.device) -> list[list[str]]:
    """Windows of one and two tokens (decode, a draft) of a SparseMoE whose experts'
    kernels take the top-k themselves, against the route kernel's choice: the layer's
    output and residual sum, bit for bit, over 20 windows each; dense bf16 experts (top-k
    by ranks) and Q4_K ones (the row kernels' top-k in k rounds)."""
    from test_moe_triton_quant import keep_quantized

    from strata.weights.random_checkpoint import RandomCheckpoint
    rows = []
    for experts, top_k, qtype in ((128, 8, None), (128, 8, "Q4_K"), (512, 10, "Q4_K")):
        layer, gen = random_moe(256, experts, top_k, device, seed=1)
        if qtype:
            checkpoint = RandomCheckpoint(f"qwen3-30b-a3b:{qtype}")
            keep_quantized(layer.experts, [
                (checkpoint.blocks(name, tuple(getattr(layer.experts, name).shape), device),
                 qtype) for name in ("gate_proj", "up_proj", "down_proj")])
        norm = RMSNorm(256, 1e-6).to(device=device, dtype=torch.bfloat16)
        same = 0
        for i in range(40):
            x, residual = (torch.randn(1 + i % 2, 256, device=device, generator=gen).bfloat16()
                           for _ in range(2))
            with torch.inference_mode():
                chosen = layer.add_norm_forward(x, residual, norm)
                layer._router_chooses = lambda *a: None  # the route kernel's path
                routed = layer.add_norm_forward(x, residual, norm)
                del layer._router_chooses
            same += all(torch.equal(a, b) for a, b in zip(chosen, routed))
        rows.append([f"{experts} experts, top-{top_k}, {qtype or 'bf16'}", f"{same}/40"])
    return rows


@contextlib.contextmanager
def pytorch_paths():
    """Projections, norms and rotations through PyTorch (the reference) inside, not
    strata/layers' Triton kernels."""
    classes = (Linear, RMSNorm, RotaryEmbedding)
    saved = [c.path for c in classes]
    for c in classes:
        c.path = "torch"
    try:
        yield
    finally:
        for c, path in zip(classes, saved):
            c.path = path


def fast_path(model: str, devices: tuple[str, ...], l2_prefetch: str = "off") -> list[str]:
    """The triton backend's bf16 logits against the reference backend's (with PyTorch's
    norms, rotation and projections: `pytorch_paths`); greedy tokens of graph replays
    against eager windows (both triton), with drafts. `l2_prefetch`: every engine's
    --l2-prefetch."""
    common = dict(model=model, devices=devices, dtype="bf16", max_context=512, parallel=4,
                  l2_prefetch=l2_prefetch)
    engines = {name: Engine(EngineConfig(**common, attention_backend=name, cuda_graphs="off",
                                         compile="off" if name == "reference" else "on"))
               for name in ("reference", "triton")}
    vocab = engines["reference"].model_config.vocab_size
    batch = prompts(4, vocab, seed=5, low=20, high=200)
    errors = []
    for ids in batch:
        with pytorch_paths():
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
