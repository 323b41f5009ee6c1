"""The coding-agent workloads through the engine in this process, without the server: N
streams at once, their total tok/s, each stream's, and the slowest window. Beside
`strata bench` (the same prompts through the OpenAI server) it tells the engine's share of
a cell from the server's (which streams every token from the same process).

    .venv/bin/python benchmarks/engine_streams.py --devices cuda:0 --spec-suffix-global 0 \
        --spec 8 --users 1,4

Each batch's prompts carry a fresh tag, as the bench's do (`--seed S`: the very prompts of
`strata bench --seed S`'s N-user cells); a first batch of one request warms the engine up
and is not reported. `windows` counts the windows the batch took until its last stream
finished (`hedges`: drafted slots that went on in a window built ahead, and those void
because a draft passed): on the CPU, where time per window says little about a GPU's, it
is how the scheduler's choices (drafts, windows sat out) compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from strata.bench.client import prompt
from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.workloads import WORKLOADS, workload
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.params import SamplingParams


def streams(llm: LLM, name: str, users: int, max_tokens: int, tag: str,
            seed: int | None = None) -> dict:
    """`users` requests of workload `name` at once, stepped as the server steps them
    (`seed`: with the prompts of the bench's cell of `users` users)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts = [prompt(name, "small", f"{seed}:{name}:users{users}:{i}") if seed is not None
             else f"[{tag}{i:02x}] " + workload(name) for i in range(users)]
    jobs = [llm.add(llm.encode_prompt(text), params) for text in texts]
    engine, worst, done = llm.engine, 0.0, {}
    hedges = engine.scheduler.hedges_taken, engine.scheduler.hedges_void
    windows = []
    engine.observers.append(lambda window, result: windows.append(window))
    start = time.perf_counter()
    while len(done) < users:
        t = time.perf_counter()
        engine.step()
        engine.launch()
        worst = max(worst, time.perf_counter() - t)
        for i, job in enumerate(jobs):
            job.advance()
            if job.request.finished and i not in done:
                done[i] = time.perf_counter() - start
    wall = time.perf_counter() - start
    engine.observers.pop()
    tokens = [job.request.num_output_tokens for job in jobs]
    return {"tok_s": sum(tokens) / wall, "stream_tok_s": [t / done[i] for i, t in
                                                          enumerate(tokens)],
            "worst_ms": worst * 1e3, "drafted": engine.draft_stats.drafted,
            "accepted": engine.draft_stats.accepted, "windows": len(windows),
            "tokens": sum(tokens), "hedges": [engine.scheduler.hedges_taken - hedges[0],
                                              engine.scheduler.hedges_void - hedges[1]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", default="1,4", help="streams at once, one batch each")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=None,
                        help="the prompts of `strata bench --seed S` (default: fresh tags)")
    add_record_flags(parser)
    add_engine_flags(parser)
    args = parser.parse_args()
    users = [int(u) for u in args.users.split(",")]
    try:
        config = engine_config(args)
        llm = LLM(dataclasses.replace(config, parallel=max(config.parallel, *users)))
    except StrataError as e:
        print(f"engine_streams: error: {e}", file=sys.stderr)
        return 2
    streams(llm, WORKLOADS[0], 1, args.max_tokens, "warm")
    rows, raw = [], []
    for name in args.workloads.split(","):
        for n in users:
            r = streams(llm, name, n, args.max_tokens, f"{name[:2]}{n}", args.seed)
            rows.append([name, n, f"{r['tok_s']:.0f}",
                         f"{min(r['stream_tok_s']):.0f}-{max(r['stream_tok_s']):.0f}",
                         f"{r['worst_ms']:.1f}", r["windows"], r["tokens"],
                         "{} / {}".format(*r["hedges"])])
            raw.append({"workload": name, "users": n, **r})
    model = args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    settings = (f"devices={','.join(config.devices)} spec={config.spec} "
                f"schedule-ahead={config.schedule_ahead} cuda-graphs={config.cuda_graphs} "
                f"max-tokens={args.max_tokens} seed={args.seed}")
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {model}\nsettings: {settings}\n")
    print(markdown_table(["workload", "streams", "tok/s", "each stream", "slowest step ms",
                          "windows", "tokens", "hedges taken / void"], rows))
    record(args, {"benchmark": "engine_streams", "model": model, "settings": settings,
                  "rows": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
