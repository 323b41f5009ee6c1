"""What `strata bench` measures: the arms (servers it starts, or a URL it is given) and the
protocol's settings, checked when built so that a bad flag is one line and exit 2. It
starts nothing and sends nothing."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from strata.bench.workloads import EDIT_FILES, TURNS, WORKLOADS
from strata.errors import StrataError

SIMULATE_FLAG = "--simulate-acceptance"
# NOTE: the harness owns these serve flags: it picks the port and listens on loopback.
OWNED_FLAGS = ("--port", "--host")


@dataclass(frozen=True)
class Arm:
    """One measured server: `flags` for one that `strata bench` starts, or `url` for an
    existing OpenAI-compatible server."""
    name: str
    flags: str | None = None
    url: str | None = None
    api_key: str | None = None

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.flags or "")

    @property
    def simulated(self) -> bool:
        """The flags turn on `--simulate-acceptance`: speed only, the text is meaningless."""
        return any(a == SIMULATE_FLAG or a.startswith(SIMULATE_FLAG + "=") for a in self.argv)

    def serve_api_key(self) -> str | None:
        """The `--api-key` among the server flags, which the client must then send."""
        argv, key = self.argv, None
        for i, a in enumerate(argv):
            if a == "--api-key" and i + 1 < len(argv):
                key = argv[i + 1]
            elif a.startswith("--api-key="):
                key = a.split("=", 1)[1]
        return key


def parse_arm(text: str) -> Arm:
    """`NAME=server flags` (the flags may be empty: the defaults of `strata serve`)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip():
        raise StrataError(f"--arm '{text}' is not NAME=\"server flags\" "
                          "(e.g. --arm \"drafts=--parallel 4 --spec 8\")")
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        raise StrataError(f"--arm '{text}': the flags do not parse as a shell line ({e})") from None
    for a in argv:
        if a.split("=", 1)[0] in OWNED_FLAGS:
            raise StrataError(f"--arm '{name.strip()}': leave out {a.split('=', 1)[0]}; "
                              "strata bench serves every arm on a free loopback port")
    return Arm(name=name.strip(), flags=flags.strip())


@dataclass(frozen=True)
class BenchConfig:
    arms: tuple[Arm, ...]
    workloads: tuple[str, ...] = WORKLOADS
    edit_file: str = "small"
    users: int = 4
    turns: int = 4                # turns of the turns workload's conversations
    max_tokens: int = 900
    timeout: float = 600.0        # per request, seconds
    start_timeout: float = 900.0  # a started server must answer /health 200 within it
    out: str = "bench-results.json"
    record: bool = False
    plot: str | None = None
    seed: int | None = None       # keys the prompts' tags; None: drawn per run
    rounds: int = 1               # the whole protocol this many times; cells: the median
    interleave: bool = False      # every arm's server up at once, arms taken in turn

    def __post_init__(self) -> None:
        if not self.arms:
            raise StrataError("nothing to measure: give --arm NAME=\"server flags\" "
                              "(repeatable) or --url URL")
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise StrataError(f"arm names must differ (got {', '.join(names)}); "
                              "name a --url arm with --name")
        unknown = [w for w in self.workloads if w not in (*WORKLOADS, TURNS)]
        if unknown or not self.workloads:
            raise StrataError(f"--workloads {','.join(self.workloads) or '(empty)'}: choose "
                              f"from {', '.join((*WORKLOADS, TURNS))}, comma-separated")
        if self.edit_file not in EDIT_FILES:
            raise StrataError(f"--edit-file {self.edit_file} is not one of "
                              f"{', '.join(EDIT_FILES)}")
        if self.users < 1:
            raise StrataError(f"--users must be at least 1 (got {self.users})")
        if self.turns < 2:
            raise StrataError(f"--turns must be at least 2 (got {self.turns}): the prefix "
                              "cache shows from turn 2")
        if self.max_tokens < 2:
            raise StrataError(f"--max-tokens must be at least 2 (got {self.max_tokens}): a "
                              "decode rate needs a first and a last token")
        if self.timeout <= 0 or self.start_timeout <= 0:
            raise StrataError("--timeout and --start-timeout must be positive seconds")
        if self.seed is not None and self.seed < 0:
            raise StrataError(f"--seed must be >= 0 (got {self.seed})")
        if self.rounds < 1:
            raise StrataError(f"--rounds must be at least 1 (got {self.rounds})")
        if self.interleave and len(self.arms) < 2:
            raise StrataError("--interleave takes the arms in turn: give two or more arms "
                              "(--arm, --url)")
        if self.plot is not None and not self.plot.lower().endswith(".png"):
            raise StrataError(f"--plot {self.plot}: give a file name ending in .png")
        if self.plot is not None and set(self.workloads) == {TURNS}:
            raise StrataError(f"--plot draws the {', '.join(WORKLOADS)} table: name one of "
                              "them in --workloads (the turns workload prints a table only)")


def bench_config(arm_texts: list[str], url: str | None, name: str | None,
                 api_key: str | None, workloads: str, **settings) -> BenchConfig:
    """BenchConfig from the command line's strings (the CLI maps onto it one to one)."""
    arms = [parse_arm(text) for text in arm_texts]
    if url is not None:
        if not url.startswith(("http://", "https://")):
            raise StrataError(f"--url {url}: give an http(s) base URL such as "
                              "http://127.0.0.1:8000/v1")
        arms.append(Arm(name=name or url, url=url.rstrip("/"), api_key=api_key))
    elif name is not None or api_key is not None:
        raise StrataError("--name and --api-key go with --url (a started arm takes "
                          "--api-key among its flags)")
    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
    return BenchConfig(arms=tuple(arms), workloads=chosen, **settings)
