"""`strata bench`: the coding-agent protocol against every arm — a fresh `strata serve` per
arm, or an existing OpenAI-compatible URL — then the tables, the raw JSON, and optionally
a results line and a plot. It owns the order of the measurements: arm after arm, or with
`--interleave` every arm's server started at once and the arms in turn per workload;
`--rounds` times, the arms' order rotated each round (`rounds` picks each cell's median
round). The requests themselves are in `client` (the turns workload's conversations in
`turns`), the server processes in `process`, the rounding in `table`."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from strata.bench.client import concurrent, measure, solo, user
from strata.bench.config import Arm, BenchConfig
from strata.bench.process import Server, log_tail, started, wait_healthy
from strata.bench.report import RESULTS, append_result, commit, machine
from strata.bench.rounds import median_workloads
from strata.bench.stages import BusyMeter
from strata.bench.table import (acceptance_table, busy_table, rate, request_workloads,
                                speed_table, spread_table, turns_table)
from strata.bench.turns import conversations
from strata.bench.workloads import TURNS
from strata.errors import StrataError

WARMUP_TOKENS = 8
# NOTE: not a workload's prompt: a drafter that learns from recent outputs (Strata's suffix
# tree) must not have seen any part of a measured answer before it is measured.
WARMUP_PROMPT = "Count from one to ten in words."


class Progress:
    """One line on stderr, rewritten in place on a terminal, one line per step otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        sys.stderr.write(f"\r\033[K{text}" if self.tty else f"{text}\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def openai_module():
    try:
        import openai
    except ImportError:
        raise StrataError("strata bench needs the openai client: pip install 'openai>=1.40' "
                          "(or the project's [bench] extra)") from None
    return openai


def openai_client(base_url: str, api_key: str | None, timeout: float):
    return openai_module().OpenAI(base_url=base_url, api_key=api_key or "none",
                                  max_retries=0, timeout=timeout)


def warm_up(client, base_url: str, progress: Progress, where: str) -> str:
    """The served model's name, after one short request that is not measured."""
    models = client.models.list().data
    if not models:
        raise StrataError(f"{base_url}/models lists no model")
    model = models[0].id
    progress(f"{where}: warm-up")
    measure(client, model, user(f"[{secrets.token_hex(4)}] {WARMUP_PROMPT}"), WARMUP_TOKENS)
    return model


def measure_workload(client, model: str, base_url: str, name: str, config: BenchConfig,
                     progress: Progress, where: str, seed: int) -> dict:
    """One workload on one server: {"solo": ..., "concurrent": ...} (the turns workload:
    {"users": N, "turns": [...]}); `seed` keys the prompts' tags (the same for every arm
    and every round of a run)."""
    if name == TURNS:
        return conversations(
            client, model, config.edit_file, config.max_tokens, config.users, config.turns,
            seed, on_turn=lambda t: progress(f"{where}: {TURNS}, turn {t}/{config.turns} "
                                             f"({config.users} conversations)"))
    progress(f"{where}: {name}, 1 user (2 requests of {config.max_tokens} tokens)")
    with BusyMeter(base_url) as meter:
        result = {"solo": solo(client, model, name, config.edit_file, config.max_tokens,
                               seed)}
    meter.annotate(result["solo"])
    if config.users > 1:
        progress(f"{where}: {name}, {config.users} users "
                 f"(1 user: {rate(result['solo']['decode_tok_s'])} tok/s)")
        with BusyMeter(base_url) as meter:
            result["concurrent"] = concurrent(client, model, name, config.edit_file,
                                              config.max_tokens, config.users, seed)
        meter.annotate(result["concurrent"])
    return result


@contextlib.contextmanager
def arm_errors(arm: Arm, log: Path | None) -> Iterator[None]:
    """A failure of this arm's server or requests as one StrataError naming the arm (and
    the end of its server log)."""
    try:
        yield
    except StrataError as e:
        raise StrataError(f"arm '{arm.name}': {e}") from None
    except (openai_module().OpenAIError, httpx.HTTPError) as e:  # connection, timeout, status
        tail = f"; the end of its log {log}:\n{log_tail(log)}" if log is not None else ""
        raise StrataError(f"arm '{arm.name}': {type(e).__name__}: {e}{tail}") from None


@dataclass
class Opened:
    """An arm ready to measure: its client, served model, base URL and server log."""
    arm: Arm
    where: str
    client: object
    model: str
    base_url: str
    log: Path | None


def arm_log(index: int, config: BenchConfig, log_dir: Path | None, round_: int) -> Path | None:
    """A started arm's server log (None for a URL arm)."""
    if config.arms[index].url is not None:
        return None
    return log_dir / (f"arm{index + 1}" + (f"-round{round_ + 1}" if config.rounds > 1 else "")
                      + ".log")


def arm_where(index: int, config: BenchConfig, round_: int) -> str:
    """The arm as progress lines name it: '[round 2/3] [1/2] drafts'."""
    where = f"[{index + 1}/{len(config.arms)}] {config.arms[index].name}"
    return f"[round {round_ + 1}/{config.rounds}] {where}" if config.rounds > 1 else where


def start(stack: contextlib.ExitStack, index: int, config: BenchConfig,
          log_dir: Path | None, progress: Progress, round_: int) -> Server:
    """Starts a flags arm's fresh `strata serve` (stopped when `stack` closes); it is not
    ready yet (`opened` waits for it)."""
    arm, log = config.arms[index], arm_log(index, config, log_dir, round_)
    progress(f"{arm_where(index, config, round_)}: starting strata serve {arm.flags}".rstrip())
    with arm_errors(arm, log):
        return stack.enter_context(started(arm.argv, log))


@contextlib.contextmanager
def opened(index: int, config: BenchConfig, log_dir: Path | None, progress: Progress,
           round_: int, server: Server | None = None) -> Iterator[Opened]:
    """The arm ready: a flags arm's fresh `strata serve` (`server`: one started already)
    answering /health, a client on it and the warm-up done; the server stopped afterwards
    (a URL arm's server is already up)."""
    arm, where = config.arms[index], arm_where(index, config, round_)
    with contextlib.ExitStack() as stack:
        if arm.url is None and server is None:
            server = start(stack, index, config, log_dir, progress, round_)
        log = server.log if server is not None else None
        with arm_errors(arm, log):
            if arm.url is None:
                wait_healthy(server.proc, server.base, log, config.start_timeout)
                base, api_key = server.base + "/v1", arm.serve_api_key()
            else:
                base, api_key = arm.url, arm.api_key
            # NOTE: closing the client on the way out (an error, Ctrl-C) drops any streams
            # still running in other threads, so the server aborts them and stops at once.
            client = stack.enter_context(openai_client(base, api_key, config.timeout))
            model = warm_up(client, base, progress, where)
        yield Opened(arm, where, client, model, base, log)


def rotated(items: list, start: int) -> list:
    """`items` from position `start` (mod its length) round to the one before it."""
    start %= len(items)
    return items[start:] + items[:start]


def run_round(config: BenchConfig, round_: int, log_dir: Path | None, progress: Progress,
              seed: int) -> list[dict]:
    """Every arm measured once, arms in an order rotated by the round: per arm its model,
    server log and workloads. `--interleave`: every arm's server up at once, the arms
    taken in turn for each workload (the first one rotating), so that the host's speed
    drifting over the run moves every arm alike."""
    arms = list(range(len(config.arms)))
    out = [{"model": None, "server_log": None, "workloads": {}} for _ in arms]

    def measure_on(i: int, at: Opened, name: str) -> None:
        with arm_errors(at.arm, at.log):
            out[i]["workloads"][name] = measure_workload(
                at.client, at.model, at.base_url, name, config, progress, at.where, seed)

    def record(i: int, at: Opened) -> None:
        out[i]["model"], out[i]["server_log"] = at.model, str(at.log) if at.log else None

    if config.interleave:
        with contextlib.ExitStack() as stack:
            servers = {i: start(stack, i, config, log_dir, progress, round_)  # all at once,
                       for i in rotated(arms, round_) if config.arms[i].url is None}
            ready = {}
            for i in rotated(arms, round_):  # then each waited for
                ready[i] = stack.enter_context(opened(i, config, log_dir, progress, round_,
                                                      servers.get(i)))
                record(i, ready[i])
            for w, name in enumerate(config.workloads):
                for i in rotated(arms, round_ + w):
                    measure_on(i, ready[i], name)
    else:
        for i in rotated(arms, round_):
            with opened(i, config, log_dir, progress, round_) as at:
                record(i, at)
                for name in config.workloads:
                    measure_on(i, at, name)
    return out


def run_arm_rounds(arm: Arm, rounds: list[dict], planned: int) -> dict:
    """One arm's record: per cell the median round's, and with more than one round
    `planned`, every round's workloads so far."""
    workloads = median_workloads([r["workloads"] for r in rounds])
    parts = [w[p] for w in workloads.values() for p in ("solo", "concurrent") if p in w]
    parts += workloads[TURNS]["turns"] if TURNS in workloads else []
    reported = any((part["drafts"] or {}).get("simulated", False) for part in parts)
    record = {"name": arm.name, "flags": arm.flags, "url": arm.url,
              "server_log": rounds[0]["server_log"], "model": rounds[0]["model"],
              "simulated": arm.simulated or reported, "workloads": workloads}
    if planned > 1:
        record["server_logs"] = [r["server_log"] for r in rounds]
        record["rounds"] = [r["workloads"] for r in rounds]
    return record


def summary(results: dict) -> dict:
    """The results line for benchmarks/results.jsonl: rates and acceptance (per turn for the
    turns workload), no requests."""
    def brief(w: dict) -> dict:
        if "turns" in w:
            return {"users": w["users"], "turns": [
                {k: v for k, v in t.items() if k not in ("requests", "drafts")}
                for t in w["turns"]]}
        many = w.get("concurrent") or {}
        drafts = w["solo"]["drafts"] or {}
        return {"solo_tok_s": w["solo"]["decode_tok_s"], "users_tok_s": many.get("total_tok_s"),
                "stream_tok_s": [many.get("stream_tok_s_min"), many.get("stream_tok_s_max")],
                "acceptance": drafts.get("acceptance")}
    return {"benchmark": "strata bench", "settings": results["settings"],
            "arms": [{"name": a["name"], "flags": a["flags"], "url": a["url"],
                      "model": a["model"], "simulated": a["simulated"],
                      "workloads": {n: brief(w) for n, w in a["workloads"].items()}}
                     for a in results["arms"]]}


def print_results(results: dict) -> None:
    print(f"machine: {results['machine']}\ncommit: {results['commit']}")
    s = results["settings"]
    turns = f" turns={s['turns']}" if TURNS in s["workloads"] else ""
    print(f"settings: workloads={','.join(s['workloads'])} edit_file={s['edit_file']} "
          f"users={s['users']}{turns} max_tokens={s['max_tokens']} temperature=0 "
          f"reasoning_effort=none seed={s.get('seed')}"
          + (f" rounds={s['rounds']}" if s.get("rounds", 1) > 1 else "")
          + (" interleave" if s.get("interleave") else ""))
    for arm in results["arms"]:
        where = f"strata serve {arm['flags']}".rstrip() if arm["url"] is None else arm["url"]
        print(f"arm {arm['name']}: {where} (model {arm['model']})")
    if request_workloads(s):  # the spread and busy tables only where they have numbers
        for text in (speed_table(results), spread_table(results), acceptance_table(results),
                     busy_table(results)):
            if text:
                print()
                print(text)
    if TURNS in s["workloads"]:
        for arm in results["arms"]:
            print()
            print(turns_table(arm))
    simulated = [a["name"] for a in results["arms"] if a["simulated"]]
    if simulated:
        print(f"\nnote: simulated arms ({', '.join(simulated)}) accept drafts at a fixed "
              "probability: their text is meaningless, only their speed counts.")


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM exits through `finally` blocks (so every started server is stopped)."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_outputs(config: BenchConfig) -> None:
    """What could fail after the measurements fails before them instead."""
    openai_module()
    if config.plot is not None:
        from strata.bench.plot import require_matplotlib
        require_matplotlib()
    if config.record and not RESULTS.parent.is_dir():
        raise StrataError(f"--record appends to {RESULTS}, which needs a source checkout")


def run(config: BenchConfig) -> dict:
    """Measures every arm, `--rounds` times; prints and writes the results; returns them."""
    check_outputs(config)
    starts = any(arm.url is None for arm in config.arms)
    log_dir = Path(tempfile.mkdtemp(prefix="strata-bench-")) if starts else None
    seed = config.seed if config.seed is not None else secrets.randbelow(2 ** 32)
    results = {"benchmark": "strata bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "machine": machine(), "commit": commit(),
               "log_dir": str(log_dir) if starts else None,
               "settings": {"workloads": list(config.workloads), "edit_file": config.edit_file,
                            "users": config.users, "turns": config.turns,
                            "max_tokens": config.max_tokens,
                            "timeout_s": config.timeout, "warmup_tokens": WARMUP_TOKENS,
                            "seed": seed, "rounds": config.rounds,
                            "interleave": config.interleave},
               "arms": []}
    progress = Progress()
    rounds: list[list[dict]] = []
    with sigterm_unwinds():
        try:
            for r in range(config.rounds):
                rounds.append(run_round(config, r, log_dir, progress, seed))
                # NOTE: written after every round: a run cut short keeps what it measured
                results["rounds_done"] = len(rounds)
                results["arms"] = [run_arm_rounds(arm, [r[i] for r in rounds], config.rounds)
                                   for i, arm in enumerate(config.arms)]
                Path(config.out).write_text(json.dumps(results, indent=1) + "\n")
        finally:
            progress.done()
    print_results(results)
    print(f"\nraw numbers: {config.out}" + (f"; server logs: {log_dir}" if starts else ""))
    if config.record:
        append_result(RESULTS, summary(results))
        print(f"recorded in {RESULTS}")
    if config.plot is not None:
        from strata.bench.plot import plot
        plot(results, config.plot)
        print(f"plot: {config.plot}")
    return results
