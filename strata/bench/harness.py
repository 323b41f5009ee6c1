"""`strata bench`: the coding-agent protocol against every arm — a fresh `strata serve` per
arm, or an existing OpenAI-compatible URL — then the tables, the raw JSON, and optionally
a results line and a plot. It owns the order of the measurements; the requests themselves
are in `client` (the turns workload's conversations in `turns`), the server processes in
`process`, the rounding in `table`."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from strata.bench.client import concurrent, measure, solo, user
from strata.bench.config import Arm, BenchConfig
from strata.bench.process import log_tail, served
from strata.bench.report import RESULTS, append_result, commit, machine
from strata.bench.stages import BusyMeter
from strata.bench.table import (acceptance_table, busy_table, rate, request_workloads,
                                speed_table, turns_table)
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


def measure_arm(base_url: str, api_key: str | None, config: BenchConfig, progress: Progress,
                where: str, seed: int) -> tuple[str, dict]:
    """The served model's name and {workload: {"solo": ..., "concurrent": ...}} (the turns
    workload: {"users": N, "turns": [...]}); `seed` keys the prompts' tags (the same for
    every arm of a run)."""
    # NOTE: closing the client on the way out (an error, Ctrl-C) drops any streams still
    # running in other threads, so the server aborts them and stops at once.
    with openai_client(base_url, api_key, config.timeout) as client:
        models = client.models.list().data
        if not models:
            raise StrataError(f"{base_url}/models lists no model")
        model = models[0].id
        progress(f"{where}: warm-up")
        measure(client, model, user(f"[{secrets.token_hex(4)}] {WARMUP_PROMPT}"), WARMUP_TOKENS)
        out = {}
        for name in config.workloads:
            if name == TURNS:
                out[name] = conversations(
                    client, model, config.edit_file, config.max_tokens, config.users,
                    config.turns, seed, on_turn=lambda t: progress(
                        f"{where}: {TURNS}, turn {t}/{config.turns} "
                        f"({config.users} conversations)"))
                continue
            progress(f"{where}: {name}, 1 user (2 requests of {config.max_tokens} tokens)")
            with BusyMeter(base_url) as meter:
                result = {"solo": solo(client, model, name, config.edit_file,
                                       config.max_tokens, seed)}
            result["solo"]["stage_busy"] = meter.fractions
            result["solo"]["expert_hits"] = meter.expert_hits
            result["solo"]["expert_upload"] = meter.expert_upload
            result["solo"]["expert_exposed"] = meter.expert_exposed
            if config.users > 1:
                progress(f"{where}: {name}, {config.users} users "
                         f"(1 user: {rate(result['solo']['decode_tok_s'])} tok/s)")
                with BusyMeter(base_url) as meter:
                    result["concurrent"] = concurrent(client, model, name, config.edit_file,
                                                      config.max_tokens, config.users, seed)
                result["concurrent"]["stage_busy"] = meter.fractions
                result["concurrent"]["expert_hits"] = meter.expert_hits
                result["concurrent"]["expert_upload"] = meter.expert_upload
                result["concurrent"]["expert_exposed"] = meter.expert_exposed
            out[name] = result
        return model, out


def run_arm(arm: Arm, index: int, config: BenchConfig, log_dir: Path | None,
            progress: Progress, seed: int) -> dict:
    where = f"[{index + 1}/{len(config.arms)}] {arm.name}"
    record = {"name": arm.name, "flags": arm.flags, "url": arm.url, "server_log": None}
    log = None
    try:
        if arm.url is not None:
            model, workloads = measure_arm(arm.url, arm.api_key, config, progress, where, seed)
        else:
            log = log_dir / f"arm{index + 1}.log"
            record["server_log"] = str(log)
            progress(f"{where}: starting strata serve {arm.flags}".rstrip())
            with served(arm.argv, log, config.start_timeout) as base:
                model, workloads = measure_arm(base + "/v1", arm.serve_api_key(), config,
                                               progress, where, seed)
    except StrataError as e:
        raise StrataError(f"arm '{arm.name}': {e}") from None
    except (openai_module().OpenAIError, httpx.HTTPError) as e:  # connection, timeout, status
        tail = f"; the end of its log {log}:\n{log_tail(log)}" if log is not None else ""
        raise StrataError(f"arm '{arm.name}': {type(e).__name__}: {e}{tail}") from None
    parts = [w[p] for w in workloads.values() for p in ("solo", "concurrent") if p in w]
    parts += workloads[TURNS]["turns"] if TURNS in workloads else []
    reported = any((part["drafts"] or {}).get("simulated", False) for part in parts)
    return {**record, "model": model, "simulated": arm.simulated or reported,
            "workloads": workloads}


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
          f"reasoning_effort=none seed={s.get('seed')}")
    for arm in results["arms"]:
        where = f"strata serve {arm['flags']}".rstrip() if arm["url"] is None else arm["url"]
        print(f"arm {arm['name']}: {where} (model {arm['model']})")
    if request_workloads(s):
        print()
        print(speed_table(results))
        print()
        print(acceptance_table(results))
        busy = busy_table(results)
        if busy:
            print()
            print(busy)
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
    """Measures every arm in turn; prints and writes the results; returns them."""
    check_outputs(config)
    started = any(arm.url is None for arm in config.arms)
    log_dir = Path(tempfile.mkdtemp(prefix="strata-bench-")) if started else None
    seed = config.seed if config.seed is not None else secrets.randbelow(2 ** 32)
    results = {"benchmark": "strata bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "machine": machine(), "commit": commit(),
               "log_dir": str(log_dir) if started else None,
               "settings": {"workloads": list(config.workloads), "edit_file": config.edit_file,
                            "users": config.users, "turns": config.turns,
                            "max_tokens": config.max_tokens,
                            "timeout_s": config.timeout, "warmup_tokens": WARMUP_TOKENS,
                            "seed": seed},
               "arms": []}
    progress = Progress()
    with sigterm_unwinds():
        try:
            for i, arm in enumerate(config.arms):
                results["arms"].append(run_arm(arm, i, config, log_dir, progress, seed))
        finally:
            progress.done()
    Path(config.out).write_text(json.dumps(results, indent=1) + "\n")
    print_results(results)
    print(f"\nraw numbers: {config.out}" + (f"; server logs: {log_dir}" if started else ""))
    if config.record:
        append_result(RESULTS, summary(results))
        print(f"recorded in {RESULTS}")
    if config.plot is not None:
        from strata.bench.plot import plot
        plot(results, config.plot)
        print(f"plot: {config.plot}")
    return results
