"""CostProfile: what one machine's stages cost, and the settings chosen for it — the
profile file that `strata calibrate` writes and `strata serve --profile` reads.

Every cost is a Curve: seconds of a window of w tokens, tabulated at the profile's widths
(1..32 for decode and verify windows, 256 for prompt chunks) and linear between and beyond
them. A profile holds one curve per layer, the
first stage's extra (the embedding) and the last stage's (final norm, lm_head, the
verifier and any MTP layer), so the cost of any layer split is a sum of curves
(`stage_costs`): calibrate measures once and compares splits without running them. It
also holds the hop between stages, the engine's own time per window, how many CPU cores
the stages share (CPU stages slow each other down when they outnumber the cores), the
acceptance each proposer showed on the sample prompts and those prompts' greedy outputs
(the simulator's traces), and `settings`: EngineConfig fields by name, which `serve
--profile` uses as defaults that flags still override.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from strata.errors import StrataError

VERSION = 1
WIDTHS = (1, 2, 4, 8, 16, 32, 256)  # decode and verify windows, and a prompt chunk


@dataclass(frozen=True)
class Curve:
    """Seconds of a window of w tokens, tabulated at ascending `widths`."""
    widths: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, w: float) -> float:
        xs, ys = self.widths, self.seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, w), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (w - x0) / (x1 - x0), 0.0)

    def __add__(self, other: Curve) -> Curve:
        if self.widths != other.widths:
            raise ValueError("curves tabulated at different widths")
        return Curve(self.widths, tuple(a + b for a, b in zip(self.seconds, other.seconds)))

    def scaled(self, factor: float) -> Curve:
        return Curve(self.widths, tuple(s * factor for s in self.seconds))


@dataclass(frozen=True)
class CostProfile:
    widths: tuple[int, ...]
    layers: tuple[tuple[float, ...], ...]  # per layer: seconds at each width
    first: tuple[float, ...]               # the first stage's extra: the embedding
    last: tuple[float, ...]                # the last stage's extra: norm, lm_head, verify, MTP
    devices: tuple[str, ...]               # one per stage of the measured machine
    hop_seconds: float = 0.0               # a hidden state's trip between stages (and back)
    host_window_seconds: float = 0.0       # the engine's time per window: schedule, commit...
    host_token_seconds: float = 0.0        # ...and per token of it (drafting, verifying)
    cpu_cores: int | None = None           # cores the CPU stages share (None: no CPU stages)
    cpu_efficiency: float = 1.0            # of those cores, the share busy CPU stages get
                                           # (calibrate fits it to N requests at once)
    stage_threads: int = 1                 # threads of each CPU stage
    acceptance: dict[str, float] = field(default_factory=dict)  # per proposer, measured
    settings: dict = field(default_factory=dict)  # EngineConfig fields chosen for this machine
    traces: dict = field(default_factory=dict)    # per workload: [prompt ids, output ids] of
                                                  # the sample requests (simulator input)
    machine: str = ""
    model: str = ""
    commit: str = ""
    note: str = ""                         # how the numbers were obtained

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def curve(self, seconds: tuple[float, ...]) -> Curve:
        return Curve(self.widths, tuple(seconds))

    def stage_costs(self, layer_split: tuple[int, ...], threads: int | None = None
                    ) -> list[Curve]:
        """C_s(w) of each stage of a split: its layers' curves, the embedding on the first
        stage, the last stage's extra on the last. `threads`: CPU stages run with this
        many threads instead of the measured `stage_threads` (time scales inversely)."""
        bounds = [0, *layer_split, self.num_layers]
        stages = []
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            total = [0.0] * len(self.widths)
            parts = list(self.layers[lo:hi])
            if s == 0:
                parts.append(self.first)
            if s == len(bounds) - 2:
                parts.append(self.last)
            for part in parts:
                total = [a + b for a, b in zip(total, part)]
            stages.append(self.curve(tuple(total)))
        if threads and self.cpu_cores is not None and threads != self.stage_threads:
            stages = [c.scaled(self.stage_threads / threads) for c in stages]
        return stages

    def stage_threads_for(self, config) -> int:
        """Threads of each CPU stage under `config` (an EngineConfig): --stage-threads, or
        the profile's cores shared out."""
        stages = len(config.layer_split) + 1 if config.stage_processes else 1
        cores = self.cpu_cores
        return config.stage_threads or (max(1, cores // stages) if cores else self.stage_threads)

    def simulated_stages(self, config) -> tuple[list[Curve], list[bool]]:
        """The stages `config` runs, as the simulator and load pricing see them: one per
        stage process, or all stages as one (in one process they run one after another);
        each one's curve, and whether it runs on the CPU."""
        if self.num_layers <= (config.layer_split[-1] if config.layer_split else 0):
            raise StrataError(f"--layer-split {','.join(map(str, config.layer_split))} does "
                              f"not fit the profile's {self.num_layers} layers")
        curves = self.stage_costs(config.layer_split, self.stage_threads_for(config))
        if config.stage_processes:
            return curves, [config.stage_device(i).type == "cpu" for i in range(len(curves))]
        return [sum(curves[1:], curves[0])], [config.stage_device(0).type == "cpu"]

    def trip_hops(self, stages: int) -> float:
        """Seconds of a window's hops: into the first stage, between stages, and back."""
        return self.hop_seconds * (stages + 1) if stages > 1 else 0.0

    def host_seconds(self, tokens: int) -> float:
        return self.host_window_seconds + self.host_token_seconds * tokens

    def save(self, path: str | Path) -> None:
        data = {"strata_profile": VERSION, **asdict(self)}
        data["settings"] = {k: list(v) if isinstance(v, tuple) else v
                            for k, v in self.settings.items()}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_profile(path: str | Path, flag: str = "--profile") -> CostProfile:
    """Read a profile file; StrataError naming the problem and the fix if it is not one."""
    path = Path(path)
    fix = "run `strata calibrate --out FILE` to write one"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StrataError(f"{flag} {path}: no such file; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"{flag} {path}: cannot read it ({e}); {fix}") from None
    except json.JSONDecodeError as e:
        raise StrataError(f"{flag} {path} is not JSON ({e.msg} at line {e.lineno}); "
                          f"{fix}") from None
    if not isinstance(data, dict) or "strata_profile" not in data:
        raise StrataError(f"{flag} {path} is not a Strata profile (no 'strata_profile' "
                          f"key); {fix}")
    if data.pop("strata_profile") != VERSION:
        raise StrataError(f"{flag} {path} is a profile of another version; {fix}")
    try:
        return _profile(data)
    except (KeyError, TypeError, ValueError) as e:
        raise StrataError(f"{flag} {path} is malformed ({e}); {fix}") from None


def _profile(data: dict) -> CostProfile:
    known = {f.name for f in fields(CostProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)}")
    for key in ("widths", "layers", "first", "last", "devices"):
        if key not in data:
            raise KeyError(f"'{key}' is missing")
    widths = tuple(int(w) for w in data["widths"])
    if not widths or list(widths) != sorted(set(widths)) or widths[0] < 1:
        raise ValueError("'widths' must be ascending whole numbers from 1")

    def seconds(name: str, values) -> tuple[float, ...]:
        row = tuple(float(v) for v in values)
        if len(row) != len(widths) or any(not v >= 0 for v in row):
            raise ValueError(f"{name} needs {len(widths)} non-negative seconds, one per width")
        return row

    layers = tuple(seconds(f"layer {i}", row) for i, row in enumerate(data["layers"]))
    if not layers:
        raise ValueError("'layers' is empty")
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError("'settings' must be an object of engine settings")
    from strata.config import EngineConfig
    flags = {f.name for f in fields(EngineConfig)}
    for name in settings:
        if name not in flags:
            raise ValueError(f"settings: '{name}' is not an engine setting")
    acceptance = {str(k): float(v) for k, v in data.get("acceptance", {}).items()}
    traces = {str(name): [[[int(t) for t in prompt], [int(t) for t in output]]
                          for prompt, output in pairs]
              for name, pairs in data.get("traces", {}).items()}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    try:  # each value checked as the flag would be (slots: as many as any split needs)
        EngineConfig(**{"parallel": 1024, **settings})
    except (StrataError, TypeError, ValueError) as e:
        raise ValueError(f"settings: {e}") from None
    cores = data.get("cpu_cores")
    return CostProfile(
        widths=widths, layers=layers, first=seconds("first", data["first"]),
        last=seconds("last", data["last"]), devices=tuple(str(d) for d in data["devices"]),
        hop_seconds=float(data.get("hop_seconds", 0.0)),
        host_window_seconds=float(data.get("host_window_seconds", 0.0)),
        host_token_seconds=float(data.get("host_token_seconds", 0.0)),
        cpu_cores=int(cores) if cores is not None else None,
        cpu_efficiency=float(data.get("cpu_efficiency", 1.0)),
        stage_threads=int(data.get("stage_threads", 1)), acceptance=acceptance,
        settings=settings, traces=traces, machine=str(data.get("machine", "")),
        model=str(data.get("model", "")), commit=str(data.get("commit", "")),
        note=str(data.get("note", "")))
