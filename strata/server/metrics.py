"""Prometheus metrics of one server (a registry of its own, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("strata_requests_rejected", "Requests refused before running",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("strata_generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("strata_prefix_cache_hit_tokens", "Prompt tokens of "
                                     "admitted requests read from the prefix cache instead of "
                                     "computed (hit rate: over strata_prompt_tokens)", registry=r)
        self.cached_blocks = Gauge("strata_prefix_cache_blocks", "KV blocks the prefix cache "
                                   "holds (shared by live requests or kept from finished ones)",
                                   registry=r)
        self.free_blocks = Gauge("strata_kv_blocks_free", "KV blocks a request can take: "
                                 "free, or cached and held by none", registry=r)
        self.used_blocks = Gauge("strata_kv_blocks_used", "KV blocks held by running "
                                 "requests (the pool: --kv-tokens / --block-size)", registry=r)
        self.host_blocks = Gauge("strata_conversation_cache_blocks", "KV blocks the host-RAM "
                                 "conversation cache holds (--conversation-cache-mib)",
                                 registry=r)
        self.restored_tokens = Counter("strata_conversation_cache_restored_tokens", "Prompt "
                                       "tokens copied back from the host-RAM conversation "
                                       "cache instead of computed", registry=r)
        self.preemptions = Counter("strata_preemptions", "Running requests whose KV blocks "
                                   "were taken back when the pool ran short (each computes "
                                   "its tokens again; raise --kv-tokens)", registry=r)
        self.queue_length = Gauge("strata_queue_length", "Requests waiting for a slot", registry=r)
        self.slots_used = Gauge("strata_slots_used", "Slots holding a running request", registry=r)
        self.slots_total = Gauge("strata_slots_total", "Slots (--parallel)", registry=r)
        self.restarts = Counter("strata_engine_restarts", "Engine restarts after a failure "
                                "(a stage process died or hung, the engine raised, a load "
                                "failed)", registry=r)
        self.window_seconds = Histogram(
            "strata_window_seconds", "Time of one engine step: send the idle groups' windows, "
            "commit the oldest", registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))

        self.draft_tokens = Counter("strata_draft_tokens", "Draft tokens sent, by proposer",
                                    ["proposer"], registry=r)
        self.draft_accepted = Counter("strata_draft_accepted_tokens",
                                      "Draft tokens accepted, by proposer", ["proposer"], registry=r)
        self.stage_busy = Counter("strata_stage_busy_seconds",
                                  "Compute time of each stage (busy fraction: its rate)",
                                  ["stage"], registry=r)
        self.scheduler_busy = Counter("strata_scheduler_busy_seconds",
                                      "Engine time scheduling, sending and committing "
                                      "windows (not waiting for results)", registry=r)
        self.draft_price = Gauge("strata_draft_price_tokens",
                                 "What drafting costs now, measured (--spec-pricing measured): "
                                 "a drafted entry and a drafted token, in tokens", ["per"],
                                 registry=r)
        self.expert_reads = Counter(
            "strata_expert_reads", "--experts-in-ram: distinct experts each window's MoE "
            "layers read, from the VRAM cache (hit) or host RAM over PCIe (miss), by stage",
            ["stage", "result"], registry=r)
        self.expert_bytes = Counter(
            "strata_expert_bytes", "--experts-in-ram: bytes over PCIe, by stage: experts "
            "read by the kernels from host RAM (read) and copied into the cache (upload)",
            ["stage", "kind"], registry=r)
        self.expert_upload_seconds = Counter(
            "strata_expert_upload_seconds", "--experts-in-ram: side-stream time of the "
            "uploads into the expert cache, by stage", ["stage"],
            registry=r)
        self.expert_exposed_seconds = Counter(
            "strata_expert_exposed_seconds", "--experts-in-ram: of those uploads, the time "
            "the compute stream waited for them (exposed), by stage", ["stage"], registry=r)
        self.expert_prefetch = Counter(
            "strata_expert_prefetch", "--expert-prefetch: experts uploaded one layer ahead "
            "(uploaded) and those of them their window read (read), by stage",
            ["stage", "result"], registry=r)
        self.expert_predicted = Counter(
            "strata_expert_predicted", "--expert-prefetch: distinct experts that layers "
            "with a prediction read (read), and those of them predicted (hit): recall is "
            "hit / read, by stage", ["stage", "result"], registry=r)
        self.new_engine()

    def new_engine(self) -> None:
        """An engine (re)started: its counts start from 0, so what was seen of the last
        one no longer holds."""
        self._seen: dict[str, tuple[int, int]] = {}
        self._expert_seen: dict[int, list[float]] = {}
        self._stage_seen: list[float] = []
        self._scheduler_seen = 0.0
        self._cached_seen = self._preempted_seen = self._restored_seen = 0
        self._prompt_seen = 0

    def observe_drafts(self, stats) -> None:
        """Add what the engine's DraftStats gained since the last call."""
        for name, s in stats.by_proposer.items():
            drafted, accepted = self._seen.get(name, (0, 0))
            if s.drafted > drafted:
                self.draft_tokens.labels(name).inc(s.drafted - drafted)
            if s.accepted > accepted:
                self.draft_accepted.labels(name).inc(s.accepted - accepted)
            self._seen[name] = (s.drafted, s.accepted)

    def observe_core(self, stats) -> None:
        """Everything a CoreStats (server/engine_core.py) says: the engine's counts since
        it started (a restarted engine counts afresh) and the steps since the last one."""
        for seconds in stats.step_seconds:
            self.window_seconds.observe(seconds)
        if stats.prompt_tokens < self._prompt_seen:
            self._prompt_seen = 0
        self.prompt_tokens.inc(stats.prompt_tokens - self._prompt_seen)
        self._prompt_seen = stats.prompt_tokens
        self.observe_drafts(stats.drafts)
        if stats.pricing is not None:
            self.observe_pricing(stats.pricing)
        self.observe_stages(stats.stage_seconds, stats.scheduler_seconds)
        self.observe_experts(stats.expert_stats)
        self.queue_length.set(stats.waiting)
        self.slots_used.set(stats.running)
        self.observe_cache(stats.cache)

    def observe_cache(self, cache) -> None:
        """The block pool's state (a CacheStats: with its host-RAM conversation cache),
        the prompt tokens the prefix cache saved and the preemptions, so far."""
        if (cache.cached_tokens < self._cached_seen or cache.preemptions < self._preempted_seen
                or cache.restored_tokens < self._restored_seen):  # a restarted engine
            self._cached_seen = self._preempted_seen = self._restored_seen = 0
        self.restored_tokens.inc(cache.restored_tokens - self._restored_seen)
        self._restored_seen = cache.restored_tokens
        self.host_blocks.set(cache.host_blocks)
        self.cached_tokens.inc(cache.cached_tokens - self._cached_seen)
        self._cached_seen = cache.cached_tokens
        self.preemptions.inc(cache.preemptions - self._preempted_seen)
        self._preempted_seen = cache.preemptions
        self.cached_blocks.set(cache.cached_blocks)
        self.free_blocks.set(cache.free_blocks)
        self.used_blocks.set(cache.used_blocks)

    def observe_pricing(self, pricing) -> None:
        """The measured draft prices (a DraftPricing) as they stand."""
        self.draft_price.labels("entry").set(pricing.entry_cost)
        self.draft_price.labels("token").set(pricing.token_cost)

    def observe_stages(self, seconds: list[float], scheduler: float = 0.0) -> None:
        """Add each stage's compute seconds (and the scheduler's) gained since the last
        call."""
        if scheduler < self._scheduler_seen:  # a restarted engine counts afresh
            self._scheduler_seen = 0.0
        self.scheduler_busy.inc(scheduler - self._scheduler_seen)
        self._scheduler_seen = scheduler
        if len(self._stage_seen) != len(seconds):
            self._stage_seen = [0.0] * len(seconds)
        for stage, (now, seen) in enumerate(zip(seconds, self._stage_seen)):
            if now > seen:
                self.stage_busy.labels(str(stage)).inc(now - seen)
        self._stage_seen = list(seconds)

    def observe_experts(self, stats: list) -> None:
        """Add what each stage's expert cache (ExpertStats, since start-up) did since the
        last call."""
        for stage, now in enumerate(stats):
            values = now.vector()
            if not any(values):
                continue
            seen = self._expert_seen.get(stage, [0.0] * len(values))
            d = type(now)(*(a - b for a, b in zip(values, seen)))  # ExpertStats, the delta
            label = str(stage)
            self.expert_reads.labels(label, "hit").inc(d.hits)
            self.expert_reads.labels(label, "miss").inc(d.misses)
            self.expert_bytes.labels(label, "read").inc(d.read_bytes)
            self.expert_bytes.labels(label, "upload").inc(d.upload_bytes)
            self.expert_upload_seconds.labels(label).inc(d.upload_seconds)
            self.expert_exposed_seconds.labels(label).inc(d.exposed_seconds)
            self.expert_prefetch.labels(label, "uploaded").inc(d.prefetched)
            self.expert_prefetch.labels(label, "read").inc(d.prefetch_used)
            self.expert_predicted.labels(label, "hit").inc(d.predicted_hits)
            self.expert_predicted.labels(label, "read").inc(d.predicted_reads)
            self._expert_seen[stage] = values

    def render(self) -> bytes:
        return generate_latest(self.registry)
