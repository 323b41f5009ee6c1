"""Solo decode speed with and without drafts on the coding-agent workloads.

    .venv/bin/python benchmarks/spec_speed.py                       # default model, CPU
    .venv/bin/python benchmarks/spec_speed.py --devices cuda:0

For each workload (edit, code, prose) and arm (no drafts, suffix, lookup, both) one
greedy request: decode tok/s (after the first token), draft acceptance, and mean
accepted tokens per drafting window. Greedy output is the same in every arm; the table
says so. Prints machine, commit and settings; `--record` appends raw numbers to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from strata.bench.report import add_record_flags, commit, machine, markdown_table, record
from strata.bench.workloads import WORKLOADS, workload
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.params import SamplingParams

ARMS = {"no drafts": dict(spec=0), "suffix": dict(spec_type=("suffix",)),
        "lookup": dict(spec_type=("lookup",)), "suffix+lookup": dict(spec_type=("suffix", "lookup"))}


def run_one(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[float, object]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    job = llm.add(prompt_ids, params)
    engine = llm.engine
    while job.request.num_output_tokens == 0:
        engine.step()
    start, first = time.perf_counter(), job.request.num_output_tokens
    while not job.request.finished:
        engine.step()
    seconds = time.perf_counter() - start
    done = job.completion()
    return (len(done.token_ids) - first) / seconds, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    add_record_flags(parser)
    add_engine_flags(parser, defaults={"max_context": 4096})
    args = parser.parse_args()
    try:
        base = engine_config(args)
        llms = {arm: LLM(dataclasses.replace(base, **overrides)) for arm, overrides in ARMS.items()}
    except StrataError as e:
        print(f"spec_speed: error: {e}", file=sys.stderr)
        return 2
    rows, raw = [], []
    for name in args.workloads.split(","):
        reference = None
        for arm, llm in llms.items():
            ids = llm.encode_prompt(workload(name))
            run_one(llm, ids[:16], 4)  # warm-up
            rate, done = run_one(llm, ids, args.max_tokens)
            reference = reference or done.token_ids
            same = "yes" if done.token_ids == reference else "NO"
            d = done.drafts
            mean = d.accepted / max(1, sum(s.windows for s in d.by_proposer.values()))
            rows.append([name, arm, f"{rate:.1f}", f"{d.acceptance:.0%}" if d.drafted else "-",
                         f"{mean:.2f}" if d.drafted else "-", same])
            raw.append({"workload": name, "arm": arm, "decode_tok_s": rate,
                        "drafts": d.as_dict(), "identical": same == "yes"})
    settings = (f"devices={','.join(base.devices)} dtype={base.torch_dtype()} spec={base.spec} "
                f"suffix_max={base.spec_suffix_max} token_cost={base.spec_token_cost} "
                f"max_tokens={args.max_tokens}")
    print(f"machine: {machine()}\ncommit: {commit()}\nmodel: {base.model or 'default'}\n"
          f"settings: {settings}\n")
    print(markdown_table(["workload", "arm", "decode tok/s", "acceptance",
                          "accepted / drafting window", "same tokens as no drafts"], rows))
    record(args, {"benchmark": "spec_speed", "model": base.model or "default",
                                 "settings": settings, "rows": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
