"""Stage: a contiguous layer range on one device, with one cache per layer.

Stage 0 also embeds tokens; the last stage also holds the final norm and lm_head and
returns logits for the rows the window asks for. A stage reads only its own tensors from
the checkpoint, builds its attention backend's metadata once per window from the header,
and decides nothing: the header says where every token goes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from tqdm import tqdm

from strata.attention import AttentionBatch, get_backend
from strata.config import EngineConfig
from strata.experts import ExpertOffload
from strata.experts.cache import ExpertCaches, ExpertStats
from strata.errors import StrataError
from strata.kvcache.cache import Cache, HostBlocks, PagedKVCache, SlotStateCache, allocate
from strata.kvcache.spec import CacheSize
from strata.layers.forward_meta import ForwardMeta
from strata.layers.fused import enable_compile
from strata.layers.linear import Linear, LinearFactory, WeightFormat
from strata.layers.moe import GroupedExperts
from strata.layers.norm import RMSNorm
from strata.layers.state_meta import StateMeta
from strata.layers.rotary import RotaryEmbedding
from strata.models.registry import Architecture, get_architecture
from strata.quant import triton_available
from strata.scheduler.window import WindowHeader
from strata.stage.buckets import WindowShape, bucket_sizes
from strata.stage.graphs import GraphCall, StageGraphs
from strata.weights.experts import STACKED
from strata.weights.loader import LoadStats, load_module

log = logging.getLogger("strata.engine")

REPORT = 1 + len(ExpertStats.names())  # numbers in a stage's report() per window


def choose_kernels(device: torch.device, dependent_launch: bool, layer_kernels: str,
                   l2_prefetch: bool = False) -> None:
    """This process's kernel choices for a CUDA stage (one config per process): programmatic
    dependent launches (--pdl), weights asked into L2 ahead (--l2-prefetch), and whether
    norms and dense projections take Strata's Triton kernels where those take the window
    (--layer-kernels)."""
    if device.type == "cuda" and triton_available():
        from strata.layers import l2_prefetch as prefetch
        from strata.layers import pdl
        pdl.enabled = dependent_launch
        prefetch.enabled = l2_prefetch
        Linear.path = RMSNorm.path = "auto" if layer_kernels == "triton" else "torch"


class StageModule(nn.Module):
    """Parameters are named as in Hugging Face checkpoints (`model.layers.7.mlp...`)."""

    def __init__(self, arch: Architecture, start: int, end: int, first: bool, last: bool,
                 mtp: bool = False):
        super().__init__()
        c = arch.config
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling)
        self.model.layers = nn.ModuleDict(
            {str(i): arch.make_layer(i, self.rotary) for i in range(start, end)})
        if last:
            self.model.norm = arch.norm(c.hidden_size, c.rms_norm_eps)
            self.lm_head = arch.linear(c.hidden_size, c.vocab_size)
        if mtp:  # the MTP layer, sharing this stage's embedding (if any) and lm_head
            self.mtp = arch.make_mtp(self.rotary, self.model.embed_tokens if first else None,
                                     self.lm_head)

    def forward(self, x: torch.Tensor, meta: ForwardMeta, caches: list[Cache]):
        """x: token ids [T] on the first stage, else hidden [T, hidden].
        Returns hidden [T, hidden]; on the last stage (logits [S, vocab] of the rows the
        window asks for, final-norm hidden [T, hidden] of every row)."""
        h = self.model.embed_tokens(x) if self.first else x
        residual = None  # each layer's output as two summands, added by the next norm
        for layer, cache in zip(self.model.layers.values(), caches):
            h, residual = layer.forward_split(h, residual, meta, cache)
        if self.last:
            normed = (self.model.norm(h) if residual is None
                      else self.model.norm.add_and_norm(h, residual)[1])
            return self.lm_head(normed[meta.logits_idx]), normed
        return h if residual is None else h + residual


class Stage:
    def __init__(self, index: int, arch: Architecture, layers: tuple[int, int], num_stages: int,
                 device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 cache_size: CacheSize, mtp: bool = False, attention_backend: str = "auto",
                 compile_layers: bool = False, offload: ExpertOffload | None = None,
                 dependent_launch: bool = True, layer_kernels: str = "triton",
                 l2_prefetch: bool = False):
        self.index, self.layers, self.device, self.dtype = index, layers, device, dtype
        self.arch, self.cache_size, self.offload = arch, cache_size, offload
        self.experts: ExpertCaches | None = None  # set by load() with --experts-in-ram
        self.graphs: StageGraphs | None = None  # set by capture_graphs()
        self.weights: LoadStats | None = None   # set by load(): what stays quantized
        last = index == num_stages - 1
        with torch.device("meta"):  # parameters are materialised one by one by load()
            self.module = StageModule(arch, *layers, first=index == 0, last=last,
                                      mtp=mtp and last)
        self.module.rotary.reset(device)
        if device.type == "cuda" and compile_layers:
            enable_compile()
        choose_kernels(device, dependent_launch, layer_kernels, l2_prefetch)
        self.backend = get_backend(attention_backend, device)

        def cache(layer: int) -> Cache:
            return allocate(arch.cache_spec(layer), cache_size, kv_dtype, device)

        self.caches = [cache(i) for i in range(*layers)]  # one per layer, in layer order
        self.keeps_state = any(isinstance(c, SlotStateCache) for c in self.caches)
        self.mtp_cache: PagedKVCache | None = (cache(arch.config.num_layers)
                                               if hasattr(self.module, "mtp") else None)
        paged = [c for c in self.caches if isinstance(c, PagedKVCache)]
        kv_bytes = sum(c.key.nbytes + c.value.nbytes for c in [*paged, self.mtp_cache]
                       if c is not None)
        if kv_bytes:
            log.info("stage %d KV cache on %s: %d tokens (%d blocks, --kv-tokens), %.0f MiB",
                     index, device, cache_size.num_blocks * cache_size.block_size,
                     cache_size.num_blocks, kv_bytes / 2**20)
        state_bytes = sum(t.nbytes for c in self.caches if isinstance(c, SlotStateCache)
                          for t in c.tensors)
        if state_bytes:
            log.info("stage %d per-slot state on %s: %d rows, %.0f MiB", index, device,
                     cache_size.num_state_rows, state_bytes / 2**20)
        self.host_blocks = None  # the conversation cache's blocks, the MTP layer's too
        if cache_size.host_blocks and paged:
            self.host_blocks = HostBlocks([*paged, *filter(None, [self.mtp_cache])],
                                          cache_size.host_blocks, cache_size.block_size)
            log.info("stage %d conversation cache in host RAM: %d blocks, %.0f MiB", index,
                     cache_size.host_blocks, self.host_blocks.nbytes / 2**20)

    def load(self, checkpoint, progress: tqdm | None = None) -> None:
        """Read this stage's tensors from the checkpoint (shapes checked), each placed on the
        stage's device as its spec says. The MTP head's names are the checkpoint's after
        `mtp.`."""
        self.weights = load_module(self.module, checkpoint, self.arch, device=self.device,
                                   dtype=self.dtype, progress=progress,
                                   checkpoint_name=lambda name: name.removeprefix("mtp."),
                                   in_host_ram=self._in_host_ram)
        log.info("stage %d weights on %s: %s", self.index, self.device,
                 self.weights.describe())
        if self.weights.host_bytes:
            self.experts = self._expert_cache()

    def _in_host_ram(self, name: str) -> bool:
        """Routed experts of the stage's layers, with --experts-in-ram."""
        return (self.offload is not None and name.startswith("model.layers.")
                and name.endswith(STACKED))

    def _expert_cache(self) -> ExpertCaches:
        """The routed experts (loaded in host RAM) behind VRAM caches of the size
        --expert-cache asks for."""
        layers = [m for m in self.module.model.layers.modules()
                  if isinstance(m, GroupedExperts)]
        routers = {id(m.experts): m.predict_experts for m in self.module.model.layers.modules()
                   if hasattr(m, "predict_experts")}
        return ExpertCaches(layers, self.device, self.offload.size, self.offload.policy,
                            self.offload.pcie_frac, self.offload.prefetch,
                            predictors=[routers[id(m)] for m in layers])

    def capture_graphs(self, config: EngineConfig) -> None:
        """Capture this stage's forward as CUDA graphs (--cuda-graphs) for windows of up
        to --cuda-graph-max-tokens tokens, one entry per slot; later windows that fit are
        replayed. `auto` captures where it can and says why not where it cannot."""
        reason = graphs_unavailable(self)
        if config.cuda_graphs == "off" or (reason and config.cuda_graphs == "auto"):
            if reason and config.cuda_graphs == "auto" and self.device.type == "cuda":
                log.info("stage %d: no CUDA graphs: %s", self.index, reason)
            return
        if reason:
            raise StrataError(f"--cuda-graphs on: {reason}")
        size = self.cache_size
        drafts = max(config.spec, config.spec_suffix_max) if config.spec else 0
        shape = WindowShape(config.parallel + 1, size.blocks_per_slot or size.num_blocks,
                            size.padding_block,
                            max_logits=max(256, config.parallel * (1 + drafts)),
                            state=self.keeps_state)
        limit = graph_token_limit(self)
        largest = min(config.cuda_graph_max_tokens, limit or config.cuda_graph_max_tokens)
        graphs = StageGraphs(self, bucket_sizes(largest), shape, self.arch.config.hidden_size)
        with torch.cuda.device(self.device):
            graphs.capture()
        self.graphs = graphs
        if self.experts is not None:
            self.experts.reset_usage()

    def report(self, seconds: float = 0.0) -> list[float]:
        """[compute seconds, the expert cache's counts since the last report...]: what
        the stage tells the engine per window (zeros where it keeps no experts in RAM)."""
        experts = (self.experts.take_stats() if self.experts is not None
                   else [0.0] * len(ExpertStats.names()))
        return [seconds, *experts]

    def move_blocks(self, header: WindowHeader) -> None:
        """The window's copies, before it computes: KV blocks to and from host RAM
        (kvcache/host.py), then rows of per-slot state (kvcache/snapshots.py)."""
        if self.experts is not None:
            self.experts.before_window()
        if self.host_blocks is not None and (header.spills or header.restores):
            self.host_blocks.copy(header.spills, header.restores)
        for source, target in header.state_copies:
            for cache in self.caches:
                if isinstance(cache, SlotStateCache):
                    for tensor in cache.tensors:
                        tensor[target].copy_(tensor[source])

    def prepare(self, header: WindowHeader) -> ForwardMeta | GraphCall:
        """What forward() needs for the window: its bucket's graph call (its metadata in the
        graph's buffers), or else its ForwardMeta on this stage's device."""
        if self.graphs is not None:
            call = self.graphs.prepare(header)
            if call is not None:
                return call
        batch = AttentionBatch(header.query_lens, header.positions, header.slot_mapping,
                               header.block_tables, header.block_size)
        state = (StateMeta.build(header.query_lens, header.starts, header.num_drafts,
                                 header.state_rows) if self.keeps_state else None)
        return ForwardMeta.build(batch, self.backend, self.device, header.logits_idx(), state)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, meta: ForwardMeta | GraphCall):
        """The window's hidden states; on the last stage (logits, hidden, the greedy
        decisions that a graphed window computes for every entry, or None: the Verifier's
        `greedy_rows`, which WindowVerifier uses where every entry is plain greedy)."""
        if isinstance(meta, GraphCall):
            out = self.graphs.replay(x, meta)
        else:
            out = self.module(x.to(self.device, non_blocking=True), meta, self.caches)
            if self.module.last:
                out = (*out, None)
        if self.experts is not None:
            self.experts.after_window()
        return out


def graphs_unavailable(stage: Stage) -> str | None:
    """Why this stage's forward cannot be captured as CUDA graphs, or None."""
    if stage.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this stage runs on {stage.device})"
    if not getattr(stage.backend, "capturable", False):
        return (f"the {stage.backend.name} attention backend's metadata changes shape with "
                "every window; use --attention-backend triton")
    if stage.keeps_state and not triton_available():
        return "layers with per-slot state are captured only with their triton kernels"
    if graph_token_limit(stage) == 0:
        return ("this model's MoE layers read expert counts on the host here (the fused MoE "
                "path needs triton on a CUDA device)")
    return None


def graph_token_limit(stage: Stage) -> int | None:
    """The largest window any of the stage's modules lets a CUDA graph capture (a MoE layer's
    fused path: its decode and verify windows; larger ones run eagerly); None: no limit."""
    limits = [m.capture_limit for m in stage.module.modules() if hasattr(m, "capture_limit")]
    return min(limits) if limits else None


def build_stage(config, model_config, index: int, cache_size: CacheSize,
                mtp: bool = False) -> Stage:
    """Stage `index` of the layer split in `config`, with unloaded (meta) weights and the
    caches the scheduler's `cache_size` implies."""
    ranges = config.stage_ranges(model_config.num_layers)
    dtype = config.torch_dtype()
    arch = get_architecture(model_config, LinearFactory(
        WeightFormat(dtype, quantized=config.keeps_quantized(index))))
    return Stage(index, arch, ranges[index], len(ranges), config.stage_device(index), dtype,
                 config.kv_dtype(), cache_size, mtp=mtp,
                 attention_backend=config.attention_backend,
                 compile_layers=config.compile == "on", offload=ExpertOffload.of(config),
                 dependent_launch=config.pdl == "on", layer_kernels=config.layer_kernels,
                 l2_prefetch=config.l2_prefetch == "on")
