"""`strata calibrate`: measure this machine's stages, choose the settings, write the profile.

With the devices given (`--devices cpu,cpu,cpu,cpu` or `cuda:0,cuda:1`), it times every
layer (measure.py), splits the layers to balance stage times, runs the sample prompts of
the coding-agent workloads through the real engine (traces, acceptance, the hops' and the
engine's time), then lets the simulator predict the table for every candidate setting
(choose.py) and writes the best into the profile, with the predicted table for it and the
runners-up. `--simulate FILE` skips the measuring and predicts from a profile (its traces,
or synthetic ones at `--acceptance` rates): the way to study hardware that is not here.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace

import torch

from strata.calibrate.choose import Prediction, balanced_split, choose, synthetic, table
from strata.calibrate.profile import WIDTHS, CostProfile, load_profile
from strata.calibrate.simulate import Trace
from strata.config import EngineConfig
from strata.errors import StrataError

CHOSEN = ("devices", "layer_split", "batch_groups", "spec", "spec_pricing", "stage_threads")


@dataclass(frozen=True)
class CalibrateOptions:
    out: str
    users: int = 4
    max_tokens: int = 128
    context: int = 256
    repeats: int = 5
    simulate: str | None = None
    acceptance: dict[str, float] | None = None  # synthetic traces per workload
    prompt_tokens: int = 1024
    output_tokens: int = 512
    workloads: tuple[str, ...] = ("code", "edit", "prose")  # sample prompts to run
    show_all: bool = False    # print every candidate's prediction


def parse_acceptance(text: str) -> dict[str, float]:
    """`code=0.85,edit=0.98,prose=0.64`."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            p = float(value)
        except ValueError:
            p = -1.0
        if not name or not 0 <= p <= 1:
            raise StrataError(f"--acceptance {text}: write workload=probability pairs with "
                              "probabilities in 0..1, e.g. code=0.85,edit=0.98,prose=0.64")
        out[name] = p
    return out


def calibrate(config: EngineConfig, options: CalibrateOptions) -> int:
    if options.simulate is not None:
        profile = load_profile(options.simulate, "--simulate")
        base = config  # the CLI made the profile's settings the defaults of its flags
        traces = _traces(profile, options)
        predictions = choose(profile, base, traces, options.acceptance)
        _print(profile, predictions, base, options)
        return 0
    profile, base = measure_profile(config, options)
    traces = _traces(profile, options)
    predictions = choose(profile, base, traces)
    best = predictions[0].config
    settings = {name: getattr(best, name) for name in CHOSEN
                if getattr(best, name) is not None}
    offload = None
    if config.experts_in_ram == "on":
        offload = _expert_settings(profile, best, options)
        settings.update(offload[0])
    profile = replace(profile, settings=settings)
    profile.save(options.out)
    _print(profile, predictions, base, options)
    if offload is not None:
        from strata.bench.report import markdown_table
        print(f"\nexpert cache ({options.users} requests at once, measured; tok/s in all):")
        print(markdown_table(["--pcie-frac", "--expert-prefetch", "tok/s", ""], offload[1]))
    print(f"\nwrote {options.out}: strata serve --profile {options.out}")
    return 0


def _expert_settings(profile: CostProfile, config: EngineConfig,
                     options: CalibrateOptions) -> tuple[dict, list[list[str]]]:
    """--pcie-frac and --expert-prefetch measured with the chosen settings, on the sample
    prompts (experts.py)."""
    from strata.calibrate.experts import choose_offload
    from strata.weights.checkpoint import open_checkpoint
    prompts = [p for pairs in profile.traces.values() for p, _ in pairs]
    prompts = (prompts * options.users)[:options.users]
    return choose_offload(config, open_checkpoint(config.model, config.mtp_model), prompts,
                          say=_say)


def _traces(profile: CostProfile, options: CalibrateOptions) -> dict[str, list[Trace]]:
    if options.acceptance:
        return synthetic(options.acceptance, options.users, options.prompt_tokens,
                         options.output_tokens)
    if not profile.traces:
        raise StrataError("the profile has no traces (sample outputs) to simulate; give "
                          "--acceptance code=0.85,edit=0.98,prose=0.64 for synthetic ones")
    return {name: [Trace(tuple(p), tuple(o)) for p, o in pairs][:max(options.users, 2)]
            for name, pairs in profile.traces.items()}


def measure_profile(config: EngineConfig, options: CalibrateOptions
                    ) -> tuple[CostProfile, EngineConfig]:
    """Time the layers, run the sample prompts, and fold both into a profile."""
    from strata.bench.report import commit, machine
    from strata.bench.workloads import WORKLOADS, workload
    from strata.calibrate.measure import layer_curves, live_run
    from strata.llm import encode_prompt
    from strata.pipeline.worker import default_threads
    from strata.weights.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(config.model, config.mtp_model)
    tokenizer = checkpoint.load_tokenizer()
    num_stages = len(config.devices)
    if config.layer_split and len(config.layer_split) + 1 != num_stages and num_stages > 1:
        raise StrataError(f"--layer-split gives {len(config.layer_split) + 1} stages but "
                          f"--devices names {num_stages}; name one device per stage")
    cpu = [d.startswith("cpu") for d in config.devices]
    threads = config.stage_threads or (default_threads(num_stages) if num_stages > 1
                                       else torch.get_num_threads())
    _say(f"timing {checkpoint.config.num_layers} layers at widths "
         f"{','.join(map(str, WIDTHS))} ({threads} threads)")
    curves = layer_curves(config, checkpoint, WIDTHS, options.context, options.repeats, threads)
    profile = CostProfile(
        widths=WIDTHS, layers=tuple(tuple(r) for r in curves.layers),
        first=tuple(curves.first), last=tuple(curves.last), devices=config.devices,
        cpu_cores=(os.cpu_count() or 1) if any(cpu) else None, stage_threads=threads,
        machine=machine(), model=config.model or "default", commit=commit(),
        note="layers timed alone; scaled per stage to a live run of the sample prompts")
    split = config.layer_split or balanced_split(profile, num_stages)
    base = replace(config, layer_split=split, stage_threads=threads if num_stages > 1 else None,
                   spec_pricing="fixed", profile=None)
    if not options.workloads:
        raise StrataError(f"--workloads names none; choose from {', '.join(WORKLOADS)}")
    for name in options.workloads:
        if name not in WORKLOADS:
            raise StrataError(f"workload {name} does not exist; choose from "
                              f"{', '.join(WORKLOADS)}")
    prompts = {name: [encode_prompt(tokenizer, f"[{i}] " + workload(name))
                      for i in range(max(options.users, 2))] for name in options.workloads}
    _say(f"running {sum(map(len, prompts.values()))} sample prompts of {options.max_tokens} "
         f"tokens with --layer-split {','.join(map(str, split)) or '(none)'}")
    run = live_run(replace(base, batch_groups=1), checkpoint, prompts, options.max_tokens)
    profile = fold_run(profile, split, run, pipelined=base.stage_processes,
                       blocking=all(cpu))
    if base.stage_processes and sum(cpu) > 1:
        profile = fit_efficiency(profile, base, checkpoint, next(iter(prompts.values())),
                                 options.users)
    return profile, base


PROBE_TOKENS = 32


def fit_efficiency(profile: CostProfile, config: EngineConfig, checkpoint,
                   prompts: list[list[int]], users: int) -> CostProfile:
    """CPU stages computing at once share the cores less well than in proportion (the
    engine, the hops' copies, switching between processes): run `users` requests at once
    (no drafts, a group per stage, PROBE_TOKENS each) and find the share of the cores
    with which the simulator's total matches the measured one."""
    from strata.calibrate.measure import concurrent_run
    from strata.calibrate.simulate import Trace, simulate
    probe = replace(config, spec=0, batch_groups=None, parallel=max(config.parallel, users))
    texts = (prompts * users)[:users]
    _say(f"probing {users} requests at once, {PROBE_TOKENS} tokens each")
    real, wall = concurrent_run(probe, checkpoint, texts, PROBE_TOKENS)
    measured = sum(n for n, _, _ in real) / wall
    traces = [Trace(tuple(p), tuple([0] * n)) for p, (n, _, _) in zip(texts, real)]

    def predicted(efficiency: float) -> float:
        return simulate(replace(profile, cpu_efficiency=efficiency), probe, traces).total_tok_s

    lo, hi = 0.05, 1.0
    if predicted(hi) <= measured:
        return profile
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return replace(profile, cpu_efficiency=round((lo + hi) / 2, 4))


def fold_run(profile: CostProfile, split: tuple[int, ...], run, pipelined: bool,
             blocking: bool) -> CostProfile:
    """Scale each stage's curves to the seconds the live run measured for it (CPU time,
    or GPU time from CUDA events), and give the rest of the run's time to the hops (stage
    processes) or the engine's host time (`blocking`: stages on the CPU in the engine's
    process, which compute inside its steps; on a GPU the engine's host time overlaps
    the windows', so the run's own count of it is taken)."""
    windows = max(len(run.windows), 1)
    stages = profile.stage_costs(split)
    layers, first, last = list(profile.layers), profile.first, profile.last
    measured_total = 0.0
    bounds = [0, *split, profile.num_layers]
    for s, curve in enumerate(stages):
        measured = sum(seconds[s] for _, seconds in run.windows if len(seconds) > s)
        predicted = sum(curve(tokens) for tokens, _ in run.windows)
        measured_total += measured
        if predicted <= 0 or measured <= 0:
            continue
        factor = measured / predicted
        for i in range(bounds[s], bounds[s + 1]):
            layers[i] = tuple(x * factor for x in layers[i])
        if s == 0:
            first = tuple(x * factor for x in first)
        if s == len(stages) - 1:
            last = tuple(x * factor for x in last)
    if pipelined:  # the engine's own time, then the hops
        host = run.host
        hop = max(run.wall - measured_total - host, 0.0) / (windows * (len(stages) + 1))
    else:  # stages run inside the engine's steps: whatever they did not take
        host, hop = (max(run.wall - measured_total, 0.0) if blocking else run.host), 0.0
    acceptance = {k: round(v, 4) for k, v in run.acceptance.items()}
    traces = {name: [[list(t.prompt), list(t.output)] for t in runs]
              for name, runs in run.traces.items()}
    return replace(profile, layers=tuple(layers), first=first, last=last, hop_seconds=hop,
                   host_window_seconds=host / windows, acceptance=acceptance, traces=traces)


def _print(profile: CostProfile, predictions: list[Prediction], base: EngineConfig,
           options: CalibrateOptions) -> None:
    from strata.bench.report import markdown_table
    print(f"profile: {profile.machine or '?'}; model {profile.model or '?'}; "
          f"{profile.num_layers} layers; devices {','.join(profile.devices)}; hop "
          f"{profile.hop_seconds * 1e3:.3f} ms; engine {profile.host_window_seconds * 1e3:.3f} "
          f"ms/window; acceptance "
          f"{', '.join(f'{k} {v:.0%}' for k, v in profile.acceptance.items()) or '-'}")
    source = (f"synthetic traces at {options.acceptance}" if options.acceptance
              else "the profile's traces")
    print(f"predicted by the simulator ({source}), {options.users} users; tok/s 1 user / "
          f"{options.users} users; best first:")
    shown = predictions if options.show_all else (
        predictions[:3] + [p for p in predictions[3:] if _reference(p, base)])
    header, rows = table(shown)
    print(markdown_table(header, rows))


def _reference(p: Prediction, base: EngineConfig) -> bool:
    """Today's defaults for these devices (groups auto, --spec 8, fixed prices)."""
    c = p.config
    return c.spec == 8 and c.spec_pricing == "fixed" and c.batch_groups == EngineConfig(
        devices=base.devices, layer_split=c.layer_split, parallel=base.parallel).num_groups()


def _say(text: str) -> None:
    print(f"calibrate: {text}", file=sys.stderr, flush=True)
