"""EngineConfig: every engine setting, typed and checked in one frozen dataclass.

The CLI is generated from these fields (cli.py reads `flag` and `help` from each
field's metadata), so a flag and its setting cannot drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import torch

from strata.errors import StrataError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _opt(help: str, flag: str | None = None, **kw) -> dict:
    return {"help": help, "flag": flag, **kw}


def auto_or_int(text: str) -> int | None:
    """CLI values like `auto` (None) or a whole number."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is neither auto nor a whole number") from None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(default=None, metadata=_opt(
        "GGUF file or Hugging Face checkpoint folder (default: the embedded SmolLM2-135M-Instruct)"))
    mtp_model: str | None = field(default=None, metadata=_opt(
        "a GGUF holding the model's MTP layer, for a GGUF --model without one (llama.cpp's "
        "convert_hf_to_gguf.py --mtp writes it); MTP drafts then join suffix and lookup"))
    devices: tuple[str, ...] = field(default=("cpu",), metadata=_opt(
        "comma-separated devices, one per stage or one for all (cpu, cuda:0,cuda:1)", list_of=str))
    layer_split: tuple[int, ...] = field(default=(), metadata=_opt(
        "layer numbers where a new stage starts, e.g. 10,20 for three stages", list_of=int))
    batch_groups: int | None = field(default=None, metadata=_opt(
        "groups of slots pipelined through the stages, one window in flight each: auto (one "
        "per stage, at most one per slot, with stage processes; 1 in one process) or N",
        parse=auto_or_int))
    stage_threads: int | None = field(default=None, metadata=_opt(
        "CPU threads of each stage process: auto (this machine's cores shared out) or N",
        parse=auto_or_int))
    stage_timeout: float = field(default=20.0, metadata=_opt(
        "seconds a window may take in the stage processes before they are declared hung "
        "and in-flight requests fail"))
    attention_backend: str = field(default="auto", metadata=_opt(
        "attention kernels every stage uses: reference (gather-then-SDPA in PyTorch, any "
        "device) or triton (a paged kernel reading the KV cache directly; CUDA only, needs "
        "the triton package, which CUDA builds of PyTorch bring); auto: triton on CUDA "
        "stages where triton is installed, else reference"))
    cuda_graphs: str = field(default="auto", metadata=_opt(
        "capture each CUDA stage's forward as graphs per window size and replay them: auto "
        "(where the attention backend and layers allow), on (fail where they do not), off",
        choices=("auto", "on", "off")))
    quantized_weights: str = field(default="off", metadata=_opt(
        "on: GGUF projection weights stored as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K stay in "
        "their blocks on the device (the file's bytes) and the matmul dequantizes inside its "
        "Triton kernel (a CPU stage dequantizes per window in PyTorch: slow, for tests); "
        "off: dequantized to --dtype at load, which is faster on the GPU today (the kernels "
        "are correct but not yet at bandwidth: benchmarks/quant_speed.py) and takes ~2-4x "
        "the memory. MoE experts stay in their blocks too; embeddings, norms, routers and "
        "other types are always dequantized",
        choices=("on", "off")))
    experts_in_ram: str = field(default="off", metadata=_opt(
        "on: every routed MoE expert stays in host RAM (pinned, in its file's format) and "
        "each stage caches as many as --expert-cache allows in VRAM; a window's experts "
        "that miss are read from host RAM over PCIe by the kernels themselves and the "
        "cache admits them (--expert-cache-policy, --pcie-frac). For models larger than "
        "the GPUs; output is the same as with every expert on the device",
        choices=("on", "off")))
    expert_cache: str = field(default="auto", metadata=_opt(
        "VRAM of each stage's expert cache (--experts-in-ram): N% of the stage's routed "
        "experts, NGiB, or auto (what free device memory holds after the other weights "
        "and the KV cache, less 10%; on a CPU stage all of them)"))
    expert_cache_policy: str = field(default="lfu", metadata=_opt(
        "which cached expert makes room for one that missed: lfu (the least used, decayed "
        "per window, of the 32 least recently used; a miss is admitted only if used "
        "more: 3-23% faster than lru on the H200 with a locality trace, "
        "docs/EXPERTS.md) or lru (least recently used; every miss is admitted)",
        choices=("lru", "lfu")))
    pcie_frac: float = field(default=1.0, metadata=_opt(
        "with --experts-in-ram: a window's uploads into the expert cache are at most this "
        "share of the experts it read (0: the cache never changes after start-up; 1: every "
        "miss may be admitted). Misses are read over PCIe either way; an upload pays "
        "off only if the expert is used again before it is evicted (docs/EXPERTS.md)"))
    expert_prefetch: int = field(default=0, metadata=_opt(
        "with --experts-in-ram: per MoE layer and window, up to this many experts that "
        "the next layer's router, applied one layer early, predicts and that are not in "
        "VRAM are copied into free cache slots while the layer computes (0: off, the "
        "default: on an H200 it cost 2-38% of the speed in 10 of 12 cases measured; "
        "strata calibrate measures it; docs/EXPERTS.md)"))
    compile: str = field(default="on", metadata=_opt(
        "on: CUDA stages run RMSNorm (with --layer-kernels torch), rotary embedding (where "
        "its Triton kernel does not take it) and the SiLU gate (where the projection after "
        "it does not) as torch.compile'd fused kernels (compiled once at start-up, in "
        "seconds); off: plain PyTorch",
        choices=("on", "off")))
    pdl: str = field(default="on", metadata=_opt(
        "on: on GPUs of compute capability 9.0 or more (Hopper), Strata's Triton kernels "
        "launch as programmatic dependents, each one's programs starting while the kernel "
        "before it finishes (elsewhere they launch plainly); off: plain launches",
        choices=("on", "off")))
    l2_prefetch: str = field(default="off", metadata=_opt(
        "on: on GPUs of compute capability 9.0 or more (Hopper), a decode or verify "
        "window's attention asks the bulk-copy unit (TMA) to bring o_proj's weight into L2 "
        "while the attention's latency-bound kernels run, and a 1-2 token MoE window's "
        "gate and up kernel its experts' down weights, so those products read them from L2 "
        "(strata/layers/l2_prefetch.py; not yet timed on a GPU: off by default); off: "
        "every weight read from device memory by its own product",
        choices=("on", "off")))
    layer_kernels: str = field(default="triton", metadata=_opt(
        "triton: on CUDA with triton, RMSNorm (with the residual add before it) and dense "
        "projections of windows of up to 64 tokens, where an H200 measured them faster than "
        "cuBLAS, run as Strata's Triton kernels (strata/layers/norm_triton.py, "
        "gemv_triton.py); torch: torch.compile's norms (with --compile on) and cuBLAS",
        choices=("triton", "torch")))
    schedule_ahead: str = field(default="auto", metadata=_opt(
        "while a group's window computes, build and launch its next one, the input tokens "
        "of its slots without drafts taken from the last window on the device (slots with "
        "drafts sit it out), so the host works while the GPU does: auto (on CUDA, in one "
        "process), on (also on the CPU, where it gains nothing: tests), off (one window per "
        "group at a time). Not with MTP drafts or stage processes",
        choices=("auto", "on", "off")))
    cuda_graph_max_tokens: int = field(default=2048, metadata=_opt(
        "largest window (tokens) replayed from a CUDA graph; larger ones run eagerly (an "
        "eager window of the default model takes ~25 ms on an H200 whatever its size)"))
    dtype: str = field(default="auto", metadata=_opt(
        "weight and activation dtype: auto (fp32 on CPU, bf16 on CUDA), fp32, bf16, fp16"))
    kv: str = field(default="auto", metadata=_opt(
        "KV cache dtype: auto (the model dtype), fp32, bf16, fp16"))
    parallel: int = field(default=1, metadata=_opt("number of slots: requests decoded at once"))
    max_context: int | None = field(default=None, metadata=_opt(
        "tokens per slot, prompt plus output (default: the model's context, at most 4096)"))
    max_window_tokens: int = field(default=2048, metadata=_opt(
        "tokens in one forward window: decode tokens first, prompt chunks fill the rest "
        "(prompts longer than this take several windows; a window above "
        "--cuda-graph-max-tokens runs eagerly, so fewer, larger prompt windows prefill "
        "faster)"))
    kv_tokens: int | None = field(default=None, metadata=_opt(
        "tokens of KV cache shared by all slots (default: --parallel x --max-context, so "
        "no request ever waits for blocks). Smaller lets --max-context be long: blocks are "
        "given to a slot as its sequence grows; when they run out, a new request waits for "
        "room and the most recently arrived running request is preempted (it computes its "
        "tokens again later, from the prefix cache's blocks where they are still cached). "
        "At least --max-context, so that one request always fits"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV cache block"))
    state_snapshots: int | None = field(default=None, metadata=_opt(
        "models with recurrent layers (Qwen3-Next, Qwen3.5): finished requests' states at "
        "their last block boundary kept on the device, so that a prompt starting with the "
        "same blocks reuses them with the prefix cache (default: --parallel; 0: such "
        "models compute every prompt whole). Each is one row of per-slot state (each "
        "stage logs the rows' MiB)"))
    conversation_cache_mib: int = field(default=0, metadata=_opt(
        "MiB of host RAM (over all stages) that keep finished conversations' KV blocks "
        "when the device pool needs their room, so that a conversation's next turn copies "
        "them back instead of computing them (0: off; needs --prefix-cache on)"))
    conversation_cache_slots: int = field(default=32, metadata=_opt(
        "conversations (finished or preempted requests' blocks, a later turn replacing "
        "the one it continues) the host-RAM cache keeps, least recently used forgotten "
        "first"))
    prefix_cache: str = field(default="on", metadata=_opt(
        "on: a request whose prompt starts with the same full blocks of tokens as a live or "
        "finished request reuses their KV blocks (kept while the pool has room, least "
        "recently used given back first) and computes only the rest; off: every prompt is "
        "computed whole. Models with recurrent layers reuse blocks where a state snapshot "
        "follows them (--state-snapshots)",
        choices=("on", "off")))
    spec: int = field(default=8, metadata=_opt(
        "most draft tokens per slot per window (0 turns drafting off); suffix drafts of long "
        "confident matches may reach --spec-suffix-max"))
    spec_type: tuple[str, ...] = field(default=(), metadata=_opt(
        "proposers to use, e.g. suffix,lookup (default: every one the model supports)",
        list_of=str))
    spec_suffix_max: int = field(default=32, metadata=_opt(
        "most draft tokens of a confident suffix-tree match"))
    spec_suffix_factor: float = field(default=1.0, metadata=_opt(
        "a suffix draft is at most this many times as long as the text it matched (a short "
        "match is a guess, a long one a copy; SuffixDecoding's max_spec_factor)"))
    spec_suffix_global: int = field(default=100_000, metadata=_opt(
        "tokens of recently finished outputs the suffix proposer drafts from (0: none; "
        "benchmarks use 0 so that requests do not draft from each other's answers)"))
    lookup_min: int = field(default=2, metadata=_opt("shortest n-gram the lookup proposer matches"))
    lookup_max: int = field(default=4, metadata=_opt("longest n-gram the lookup proposer matches"))
    spec_min_p: float = field(default=0.3, metadata=_opt(
        "an MTP draft chain stops when a draft token's probability falls below this"))
    spec_token_cost: float = field(default=0.05, metadata=_opt(
        "cost of one more token in a window, as a fraction of a one-token window; a draft "
        "token is sent only while its expected acceptance exceeds it"))
    spec_window_cost: float = field(default=1.0, metadata=_opt(
        "with windows built ahead (--schedule-ahead): what a slot gives up by carrying "
        "drafts, in tokens: it sits out the window built ahead of its drafted one (the "
        "group's other slots go on; a slot alone makes the group wait, and the host's time "
        "shows). A draft is sent only when its expected gain exceeds this"))
    spec_hedge: str = field(default="on", metadata=_opt(
        "with windows built ahead: on, a slot that carries drafts in the window in flight "
        "goes on in the window built ahead (where other slots go on too) as if all its "
        "drafts failed, one token on from its last known one; if a draft passes, that entry "
        "is void and dropped. off: the slot sits that window out (docs/SPECULATIVE.md)",
        choices=("on", "off")))
    spec_pricing: str = field(default="fixed", metadata=_opt(
        "fixed (default): drafts cost --spec-window-cost and --spec-token-cost; shared: "
        "fixed, with a draft token's --spec-token-cost charged once for every slot its window "
        "carries (a longer window delays each slot's next token); measured: "
        "drafting is also charged what the engine's recent steps show a drafted entry and "
        "a drafted token cost (host and device time, in the tokens the engine would have "
        "made meanwhile), added to those (slower than fixed on the H200 so far: "
        "docs/SPECULATIVE.md); load: a draft costs what its tokens add to the busiest "
        "stage's time when every stage is busy, or to its own group's trip through the "
        "stages when they wait on each other, in the tokens the engine makes meanwhile "
        "(the stages' costs from --profile, else measured per window; docs/BATCHING.md)",
        choices=("fixed", "shared", "measured", "load")))
    profile: str | None = field(default=None, metadata=_opt(
        "a profile written by `strata calibrate`: its settings become the defaults (flags "
        "given still win) and its stage costs price drafts under --spec-pricing load"))
    simulate_acceptance: float | None = field(default=None, metadata=_opt(
        "speed studies only: every slot drafts --spec tokens every window and accepts each "
        "with this probability (the text is meaningless; everything is labelled simulated)"))

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise StrataError(f"--dtype {self.dtype} is not one of auto, {', '.join(DTYPES)}")
        if self.kv not in ("auto", *DTYPES):
            raise StrataError(f"--kv {self.kv} is not one of auto, {', '.join(DTYPES)}")
        from strata.attention import backend_names
        if self.attention_backend not in ("auto", *backend_names()):
            raise StrataError(f"--attention-backend {self.attention_backend} does not exist; "
                              f"available: {', '.join(backend_names())}")
        for f in fields(self):  # settings with a fixed set of values name them
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise StrataError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)} is "
                                  f"not one of {', '.join(choices)}")
        for name in ("parallel", "max_window_tokens", "block_size", "cuda_graph_max_tokens"):
            if getattr(self, name) < 1:
                raise StrataError(f"--{name.replace('_', '-')} must be at least 1 "
                                  f"(got {getattr(self, name)})")
        if self.spec_suffix_factor <= 0:
            raise StrataError(f"--spec-suffix-factor must be above 0 (got "
                              f"{self.spec_suffix_factor})")
        if self.spec < 0 or self.spec_suffix_max < 0 or self.spec_suffix_global < 0:
            raise StrataError("--spec, --spec-suffix-max and --spec-suffix-global must be >= 0")
        if not 1 <= self.lookup_min <= self.lookup_max:
            raise StrataError(f"--lookup-min {self.lookup_min} and --lookup-max {self.lookup_max}"
                              ": need 1 <= min <= max")
        if not 0 <= self.spec_min_p <= 1 or not 0 <= self.spec_token_cost < 1:
            raise StrataError("--spec-min-p must be in [0, 1] and --spec-token-cost in [0, 1)")
        if self.spec_window_cost < 0:
            raise StrataError(f"--spec-window-cost must be >= 0 (got {self.spec_window_cost})")
        if self.simulate_acceptance is not None:
            if not 0 <= self.simulate_acceptance <= 1:
                raise StrataError(f"--simulate-acceptance {self.simulate_acceptance} must be "
                                  "a probability in [0, 1]")
            if self.spec == 0:
                raise StrataError("--simulate-acceptance needs drafts: give --spec K > 0")
        if self.batch_groups is not None and not 1 <= self.batch_groups <= self.parallel:
            raise StrataError(f"--batch-groups {self.batch_groups}: need between 1 and "
                              f"--parallel ({self.parallel}) groups, or auto")
        if self.stage_threads is not None and self.stage_threads < 1:
            raise StrataError(f"--stage-threads must be at least 1 (got {self.stage_threads})")
        if self.stage_timeout <= 0:
            raise StrataError(f"--stage-timeout must be positive (got {self.stage_timeout})")
        if self.max_context is not None and self.max_context < 2:
            raise StrataError(f"--max-context must be at least 2 (got {self.max_context})")
        if self.conversation_cache_mib < 0 or self.conversation_cache_slots < 1:
            raise StrataError("--conversation-cache-mib must be >= 0 and "
                              "--conversation-cache-slots at least 1")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise StrataError(f"--state-snapshots must be >= 0 (got {self.state_snapshots})")
        if self.pcie_frac < 0:
            raise StrataError(f"--pcie-frac must be >= 0 (got {self.pcie_frac})")
        if self.expert_prefetch < 0:
            raise StrataError(f"--expert-prefetch must be >= 0 (got {self.expert_prefetch})")
        self.expert_cache_size()  # checked here, resolved by each stage
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise StrataError(f"--kv-tokens must be at least 1 (got {self.kv_tokens})")
        if not self.devices:
            raise StrataError("--devices needs at least one device, e.g. cpu or cuda:0")
        for device in self.devices:
            try:
                torch.device(device)
            except RuntimeError:
                raise StrataError(f"--devices: '{device}' is not a device name "
                                  "(use cpu, cuda or cuda:N)") from None
        if list(self.layer_split) != sorted(set(self.layer_split)) or any(
                b < 1 for b in self.layer_split):
            raise StrataError(f"--layer-split {','.join(map(str, self.layer_split))}: stage "
                              "boundaries must be strictly increasing layer numbers above 0")

    def stage_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, end) layer range of each stage, checked against the model."""
        bounds = [0, *self.layer_split, num_layers]
        if self.layer_split and self.layer_split[-1] >= num_layers:
            raise StrataError(f"--layer-split {','.join(map(str, self.layer_split))}: every "
                              f"boundary must be between 1 and {num_layers - 1} (the model has "
                              f"{num_layers} layers)")
        ranges = list(zip(bounds[:-1], bounds[1:]))
        if len(self.devices) not in (1, len(ranges)):
            raise StrataError(f"--devices lists {len(self.devices)} devices for {len(ranges)} "
                              "stages; give one device, or one per stage")
        return ranges

    @property
    def stage_processes(self) -> bool:
        """One process per stage when a split lists a device per stage (cpu,cpu counts);
        one device for every stage runs them all in this process."""
        return bool(self.layer_split) and len(self.devices) > 1

    def num_groups(self) -> int:
        """--batch-groups, with auto resolved: one group per stage (at most one per slot)
        with stage processes, else one."""
        if self.batch_groups is not None:
            return self.batch_groups
        if not self.stage_processes:
            return 1
        return min(len(self.layer_split) + 1, self.parallel)

    def stage_device(self, stage: int) -> torch.device:
        return torch.device(self.devices[0] if len(self.devices) == 1 else self.devices[stage])

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return torch.bfloat16 if self.stage_device(0).type == "cuda" else torch.float32

    def keeps_quantized(self, stage: int) -> bool:
        """Do stage `stage`'s projections stay in their GGUF blocks (--quantized-weights)?
        (Per stage, so that a later rule may choose by device and memory.)"""
        if self.quantized_weights != "on":
            return False
        from strata import quant
        if self.stage_device(stage).type == "cuda" and not quant.triton_available():
            raise StrataError("--quantized-weights on needs the triton package on CUDA "
                              "stages (its kernels multiply the blocks): pip install "
                              "'strata[gpu]', or leave --quantized-weights off")
        return True

    def expert_cache_size(self) -> tuple[str, float]:
        """--expert-cache as ("auto", 0), ("share", fraction of the experts) or ("bytes", N)."""
        text = self.expert_cache.strip().lower().replace(" ", "")
        if text == "auto":
            return "auto", 0.0
        try:
            if text.endswith("%"):
                share = float(text[:-1]) / 100
                if 0 <= share <= 1:
                    return "share", share
            elif text.endswith("gib"):
                size = float(text[:-3])
                if size >= 0:
                    return "bytes", size * 2**30
        except ValueError:
            pass
        raise StrataError(f"--expert-cache {self.expert_cache}: give a share of the experts "
                          "(0% to 100%, e.g. 25%), a size (e.g. 12GiB) or auto")

    def kv_dtype(self) -> torch.dtype:
        return self.torch_dtype() if self.kv == "auto" else DTYPES[self.kv]
