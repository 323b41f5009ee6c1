"""What `strata calibrate` measures on the real devices.

- **Layer curves** (`layer_curves`): every layer alone as a stage of an in-process split
  (one layer per stage, on the first device, with the threads a stage process would
  have), timed on decoding windows of w tokens (the last token and w - 1 drafts) after a
  `context`-token prefix. The first and the last stage's time beyond a typical layer is
  the embedding and the norm + lm_head.
- **A live run** (`live_run`): the sample prompts, one at a time, through a real engine
  with the devices and split given (stage processes when there are several): greedy
  outputs (the simulator's traces), each proposer's acceptance, and per window its tokens
  and each stage's seconds. Each stage's curves are scaled so that they sum to what the
  stages measured in the run, and what the run took beyond stages and the engine's host
  time is the hops' share.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from strata.calibrate.simulate import Trace
from strata.config import EngineConfig
from strata.drafting.draft import Draft
from strata.engine.engine import Engine
from strata.sampling.params import SamplingParams


def stage_inputs(engine: Engine, width: int, context: int) -> list:
    """Each stage's (input, header) for a decoding window of `width` tokens (the last token
    and width - 1 drafts, so the last stage computes `width` logits rows) after `context`."""
    scheduler = engine.scheduler
    slot = scheduler.slots[0]
    tokens = torch.randint(0, engine.model_config.vocab_size, (context + width,)).tolist()
    request = engine.add_request(tokens[:context + 1], SamplingParams(temperature=0))
    scheduler._admit(scheduler.groups[0])
    slot.num_computed = context  # NOTE: the prefix KV is whatever the cache holds: speed only
    slot.draft = Draft(tokens[context + 1:], [1.0] * (width - 1)) if width > 1 else None
    window = scheduler._build(0, [(slot, width)])
    scheduler.in_flight.pop(0, None)
    inputs, x = [], window.header.token_ids
    for stage in engine.runner.stages:
        inputs.append((x, window.header))
        out = stage.forward(x, stage.prepare(window.header))
        x = out if not isinstance(out, tuple) else None
    engine.abort(request.request_id)
    return inputs


def time_stage(stage, x, header, repeats: int) -> float:
    """Median seconds of the stage's forward on one window (synchronised on a GPU)."""
    meta = stage.prepare(header)
    times = []
    for _ in range(repeats):
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)
        start = time.perf_counter()
        stage.forward(x, meta)
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class LayerCurves:
    layers: list[list[float]]  # per layer: seconds at each width
    first: list[float]
    last: list[float]


def layer_curves(config: EngineConfig, checkpoint, widths: tuple[int, ...], context: int,
                 repeats: int, threads: int) -> LayerCurves:
    num_layers = checkpoint.config.num_layers
    alone = replace(config, devices=(config.devices[0],), layer_split=tuple(range(1, num_layers)),
                    batch_groups=None, parallel=1, spec=max(widths) - 1, spec_pricing="fixed",
                    profile=None, cuda_graphs="off", max_context=context + max(widths) + 64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = None
    try:
        engine = Engine(alone, checkpoint)
        with torch.inference_mode():
            times = []  # [width][stage]
            for width in widths:
                inputs = stage_inputs(engine, width, context)
                times.append([time_stage(stage, x, header, repeats)
                              for stage, (x, header) in zip(engine.runner.stages, inputs)])
    finally:
        if engine is not None:
            engine.close()
        torch.set_num_threads(previous)
    per_layer = [[times[i][layer] for i in range(len(widths))] for layer in range(num_layers)]
    middle = per_layer[1:-1] or per_layer
    typical = [statistics.median(row[i] for row in middle) for i in range(len(widths))]
    if num_layers < 3:
        return LayerCurves(per_layer, [0.0] * len(widths), [0.0] * len(widths))
    first = [max(a - b, 0.0) for a, b in zip(per_layer[0], typical)]
    last = [max(a - b, 0.0) for a, b in zip(per_layer[-1], typical)]
    return LayerCurves([typical if i in (0, num_layers - 1) else row
                        for i, row in enumerate(per_layer)], first, last)


@dataclass
class LiveRun:
    traces: dict[str, list[Trace]]             # per workload
    acceptance: dict[str, float]               # per proposer
    windows: list[tuple[int, list[float]]] = field(default_factory=list)  # tokens, stage s
    wall: float = 0.0
    host: float = 0.0                          # the engine's own seconds


def live_run(config: EngineConfig, checkpoint, prompts: dict[str, list[list[int]]],
             max_tokens: int) -> LiveRun:
    """Every prompt alone, greedy, through an engine of `config` (after a short warm-up
    request that is not counted)."""
    engine = Engine(config, checkpoint)
    run = LiveRun({}, {})
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    try:
        warmup = next(iter(prompts.values()))[0]
        engine.generate([warmup], SamplingParams(temperature=0, max_tokens=8))
        engine.observers.append(
            lambda window, result: run.windows.append((window.header.num_tokens,
                                                       list(result.stage_seconds))))
        before = engine.draft_stats.as_dict()["by_proposer"]
        for name, texts in prompts.items():
            run.traces[name] = []
            for ids in texts:
                start, host = time.perf_counter(), engine.scheduler_seconds
                output = engine.generate([ids], params)[0]
                run.wall += time.perf_counter() - start
                run.host += engine.scheduler_seconds - host
                run.traces[name].append(Trace(tuple(ids), tuple(output)))
        for name, s in engine.draft_stats.by_proposer.items():
            drafted = s.drafted - before.get(name, {}).get("drafted", 0)
            accepted = s.accepted - before.get(name, {}).get("accepted", 0)
            run.acceptance[name] = accepted / drafted if drafted else 0.0
    finally:
        engine.close()
    return run


def concurrent_run(config: EngineConfig, checkpoint, prompts: list[list[int]],
                   max_tokens: int) -> tuple[list[tuple[int, float, float]], float]:
    """The prompts sent together, greedy, through an engine of `config` (after a short
    warm-up): per request its tokens and the seconds to its first and last token, and
    the wall time — what the simulator predicts for the same requests."""
    engine = Engine(config, checkpoint)
    try:
        engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        requests = [engine.add_request(ids, params) for ids in prompts]
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        start = time.perf_counter()
        while engine.has_work:
            for request in engine.step():
                now = time.perf_counter() - start
                first.setdefault(request.request_id, now)
                last[request.request_id] = now
        wall = time.perf_counter() - start
    finally:
        engine.close()
    return [(r.num_output_tokens, first[r.request_id], last[r.request_id])
            for r in requests], wall
