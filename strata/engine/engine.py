"""Engine: the loop that turns requests into tokens.

`step()` sends a window for every idle group with work (the scheduler picks them), then
collects the oldest window's result and commits it; `launch()` is its first half alone.
The runner is either the stages in this process (ModelRunner) or one process per stage
(PipelineRunner); both return results in submission order. Tokens in, tokens out: text,
chat templates and stop strings belong to the caller (strata/llm.py, the server).
"""

from __future__ import annotations

import logging
import time

import torch

from strata.config import EngineConfig
from strata.drafting.pricing import StepMeter
from strata.drafting.registry import build_policy
from strata.engine.stalls import StallWatch
from strata.experts.cache import ExpertStats
from strata.errors import StrataError
from strata.kvcache.spec import PagedKVSpec, keeps_slot_state
from strata.models.registry import get_architecture
from strata.request import DraftStats, Request
from strata.sampling.params import SamplingParams
from strata.scheduler.scheduler import Scheduler
from strata.stage.runner import ModelRunner, Runner
from strata.weights.checkpoint import open_checkpoint

log = logging.getLogger("strata.engine")


def context_size(config: EngineConfig, model_config) -> int:
    """Tokens per slot: --max-context, or the model's context up to 4096."""
    return config.max_context or min(model_config.max_position, 4096)


def check_prompt(prompt_ids: list[int], max_context: int, vocab: int) -> None:
    """Raise StrataError if the prompt cannot run in one slot (callable before loading)."""
    if not prompt_ids:
        raise StrataError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= max_context:
        raise StrataError(f"the prompt is {len(prompt_ids)} tokens but --max-context is "
                          f"{max_context} (prompt plus at least one generated token); "
                          "shorten the prompt or raise --max-context")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise StrataError(f"prompt token ids must be in 0..{vocab - 1}")


def schedules_ahead(config: EngineConfig) -> bool:
    """--schedule-ahead: on, or auto with the first stage on CUDA; never with stage
    processes (the tokens carried over live on the last stage's device)."""
    if config.stage_processes or config.schedule_ahead == "off":
        return False
    return config.schedule_ahead == "on" or config.stage_device(0).type == "cuda"


class Engine:
    def __init__(self, config: EngineConfig, checkpoint=None):
        self.config = config
        self.checkpoint = (checkpoint if checkpoint is not None
                           else open_checkpoint(config.model, config.mtp_model))
        self.model_config = self.checkpoint.config
        self.max_context = context_size(config, self.model_config)
        if self.max_context > self.model_config.max_position:
            raise StrataError(f"--max-context {self.max_context} is larger than the model's "
                              f"context of {self.model_config.max_position} tokens; lower it")
        policy = build_policy(config, self.model_config)
        use_mtp = policy is not None and policy.on_last_stage
        arch = get_architecture(self.model_config)
        if arch.released_with_mtp and not self.model_config.num_mtp_layers and config.spec:
            log.info("%s has no MTP layer (quantized GGUFs often leave it out): drafts come "
                     "from the suffix and lookup proposers; --mtp-model FILE adds the layer "
                     "from an MTP GGUF", self.checkpoint.path.name)
        stateful = keeps_slot_state(
            arch.cache_spec(i) for i in range(self.model_config.num_layers + use_mtp))
        # A slot's state rows: its committed state, and the states after its last known
        # token and each draft of a window (so drafts are capped at --spec here).
        max_drafts = config.spec if stateful and policy is not None else None
        rows_per_slot = 2 + (max_drafts or 0) if stateful else 0
        snapshots = (config.state_snapshots if config.state_snapshots is not None
                     else config.parallel) if stateful else 0
        prefix_cache = config.prefix_cache == "on" and (not stateful or snapshots > 0)
        if config.prefix_cache == "on" and not prefix_cache:
            log.info("the prefix cache is off: --state-snapshots is 0")
        self.scheduler = Scheduler(config.parallel, self.max_context, config.max_window_tokens,
                                   config.block_size, policy,
                                   mtp_drafts=config.spec if use_mtp else 0,
                                   num_groups=config.num_groups(),
                                   state_rows_per_slot=rows_per_slot,
                                   ahead=schedules_ahead(config),
                                   hedge=config.spec_hedge == "on",
                                   window_cost=config.spec_window_cost,
                                   max_drafts=max_drafts, prefix_cache=prefix_cache,
                                   kv_tokens=config.kv_tokens,
                                   host_blocks=self._host_blocks(
                                       arch, prefix_cache, self.model_config.num_layers + use_mtp),
                                   host_conversations=config.conversation_cache_slots,
                                   state_snapshots=snapshots)
        drafts = self.scheduler.drafts
        self.draft_stats = drafts.stats if drafts is not None else DraftStats()  # all requests
        pricing = drafts.pricing if drafts is not None else None
        self.meter = StepMeter(pricing) if pricing is not None else None  # feeds it
        self.load = drafts.load if drafts is not None else None  # --spec-pricing load
        if config.stage_processes:
            from strata.pipeline.runner import PipelineRunner
            runner = PipelineRunner
        else:
            runner = ModelRunner
        self.runner: Runner = runner(config, self.checkpoint, self.scheduler.cache_size,
                                     mtp=use_mtp)
        self.stage_seconds = [0.0] * self.runner.num_stages  # compute time of each stage
        # what each stage's expert cache did (--experts-in-ram), since start-up
        self.expert_stats = [ExpertStats() for _ in range(self.runner.num_stages)]
        self.scheduler_seconds = 0.0  # time in step() outside collect: scheduling, commits
        self.stalls = StallWatch()    # warns of a step whose host time stalled
        # Stages computing in this process on the CPU: their time is compute, not a stall.
        self._cpu_stages = [] if config.stage_processes else [
            i for i in range(self.runner.num_stages) if config.stage_device(i).type == "cpu"]
        self._launching = 0.0         # seconds launching windows since the last commit,
        self._computing = 0.0         # and the CPU stages' compute within them
        self.observers: list = []     # called with (window, result) of each commit
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

    def _host_blocks(self, arch, prefix_cache: bool, num_layers: int) -> int:
        """Blocks of the host-RAM conversation cache that --conversation-cache-mib holds:
        a block's keys and values in every attention layer of every stage (the MTP
        layer's among the `num_layers`)."""
        config = self.config
        if not config.conversation_cache_mib:
            return 0
        if not prefix_cache:
            log.info("the conversation cache is off: it keeps the prefix cache's blocks, "
                     "and the prefix cache is off")
            return 0
        itemsize = torch.empty(0, dtype=config.kv_dtype()).element_size()
        per_block = sum(2 * spec.num_kv_heads * spec.head_dim * config.block_size * itemsize
                        for spec in map(arch.cache_spec, range(num_layers))
                        if isinstance(spec, PagedKVSpec))
        blocks = config.conversation_cache_mib * 2**20 // per_block
        if not blocks:
            raise StrataError(f"--conversation-cache-mib {config.conversation_cache_mib} "
                              f"holds no block of {per_block / 2**20:.2f} MiB; raise it")
        return blocks

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise StrataError if the prompt cannot run in one slot."""
        check_prompt(prompt_ids, self.max_context, self.model_config.vocab_size)

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    eos_token_ids: frozenset[int] | None = None) -> Request:
        request = Request(list(prompt_ids), params,
                          eos_token_ids if eos_token_ids is not None else self.eos_token_ids)
        if request_id is not None:
            request.request_id = request_id
        return self.add(request)

    def add(self, request: Request) -> Request:
        """Queue a request for a slot; raises StrataError if its prompt cannot run."""
        self.check_prompt(request.prompt_ids)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @torch.inference_mode()
    def launch(self) -> None:
        """Send a window for each idle group with work: what step() starts with. A caller
        with work of its own per step (the server streaming tokens out) calls it right
        after step(), so that work overlaps the windows' compute."""
        start, gc_before = time.perf_counter(), self.stalls.collected()
        while (window := self.scheduler.schedule()) is not None:
            self._submit(window, start)
        while (window := self.scheduler.schedule_ahead()) is not None:
            self._submit(window, start)
        spent = time.perf_counter() - start
        self.scheduler_seconds += spent
        # The collector's runs inside the launch are told apart (StallWatch).
        self._launching += spent - (self.stalls.collected() - gc_before)

    def _submit(self, window, start: float) -> None:
        idle = self.runner.num_in_flight == 0
        if idle:
            self.stalls.idle(start)
            self._launching = self._computing = 0.0
        if self.meter is not None:
            self.meter.launched(window, start, idle)
        if idle and self.load is not None:
            self.load.resume(start)
        self.runner.submit(window)
        if self._cpu_stages:  # in this process: they computed the window just now
            seconds = self.runner.submitted_seconds
            self._computing += sum(seconds[i] for i in self._cpu_stages)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Send a window for each idle group with work, then commit the oldest window in
        flight; return the requests that received tokens."""
        self.launch()
        start = time.perf_counter()
        if self.runner.num_in_flight == 0:
            return self.scheduler.take_failed()
        collect, gc_before = time.perf_counter(), self.stalls.collected()
        window, result = self.runner.collect()
        commit = time.perf_counter()
        gc_in_wait = self.stalls.collected() - gc_before  # host time inside the wait
        for stage, seconds in enumerate(result.stage_seconds):
            self.stage_seconds[stage] += seconds
        for stats, delta in zip(self.expert_stats, result.expert_stats):
            stats.add(delta)
        for observe in self.observers:
            observe(window, result)
        if self.meter is not None:
            self.meter.committed(window, result.tokens, commit)
        if self.load is not None:
            seconds = result.stage_seconds
            self.load.observe(window.header.group, window.header.num_tokens,
                              seconds if self.config.stage_processes else [sum(seconds)],
                              sum(len(t) for t in result.tokens), commit)
        # The CPU stages' compute since the last commit (the windows launched in this
        # step, not the one collected: with windows built ahead they differ) is theirs.
        self.stalls.committed(commit, self._launching - self._computing,
                              commit - collect - gc_in_wait + self._computing)
        self._launching = self._computing = 0.0
        updated = self.scheduler.commit(window, result.tokens, result.stage_drafts,
                                        result.errors, result.logprobs)
        self.scheduler_seconds += (collect - start) + (time.perf_counter() - commit)
        return updated

    def close(self) -> None:
        """Stop the stage processes (if any); the engine cannot run afterwards."""
        self.runner.close()

    @torch.inference_mode()
    def score(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] at every prompt position (prompt logprobs, tests). Runs the
        prompt through its windows like any request; the engine must be idle."""
        if self.has_work:
            raise RuntimeError("score() needs an idle engine")
        request = Request(list(prompt_ids), SamplingParams(temperature=0, max_tokens=1),
                          self.eos_token_ids, reuse_prefix=False)  # every position's logits
        self.add(request)
        rows = []
        while self.has_work:
            window = self.scheduler.schedule()
            window.header.logits_all = True
            self.runner.submit(window)
            window, result = self.runner.collect()
            rows.append(result.logits)
            self.scheduler.commit(window, result.tokens)
        return torch.cat(rows)[:len(prompt_ids)]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion together; their output token ids, in order."""
        requests = [self.add_request(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return [r.output_ids for r in requests]
