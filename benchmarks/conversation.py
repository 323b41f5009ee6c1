"""A coding agent's conversation, turn by turn, with and without the prefix cache: each
turn's prompt is the whole conversation so far (the file, every earlier request and
answer) plus a new request, as agents send it. Prints per turn the prompt length, the
time to first token, the prompt tokens read from the cache, the decode rate, draft
acceptance and whether the text equals the run without the cache (greedy), with machine,
commit and settings.

    .venv/bin/python benchmarks/conversation.py                          # default model, CPU
    .venv/bin/python benchmarks/conversation.py --devices cuda:0 --turns 6 --max-tokens 400

The requests run one at a time through the engine in this process (no server); the turns'
requests are the `turns` workload's (strata/bench/workloads.py), which `strata bench
--workloads turns` sends to servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from strata.bench.report import commit, machine, markdown_table
from strata.bench.workloads import turn_request
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.params import SamplingParams


def turn(llm: LLM, messages: list[dict], max_tokens: int) -> dict:
    ids = llm.encode_prompt(messages)
    job = llm.add(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    request, engine = job.request, llm.engine
    start = time.perf_counter()
    while request.num_output_tokens == 0 and not request.finished:
        engine.step()
    first = time.perf_counter()
    while not request.finished:
        engine.step()
    end = time.perf_counter()
    text = llm.tokenizer.decode(request.output_ids)
    stats = request.draft_stats
    return {"prompt": len(ids), "cached": request.num_cached_tokens,
            "ttft": first - start, "tokens": request.num_output_tokens,
            "decode": (request.num_output_tokens - 1) / (end - first) if end > first else 0.0,
            "acceptance": stats.acceptance if stats.drafted else None, "text": text}


def conversation(llm: LLM, turns: int, max_tokens: int) -> list[dict]:
    messages, out = [], []
    for i in range(1, turns + 1):
        messages.append({"role": "user", "content": turn_request(i, "small")})
        result = turn(llm, messages, max_tokens)
        out.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(parser, defaults={"spec_suffix_global": 0, "max_context": 8192})
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    rows, texts = [], {}
    try:
        config = engine_config(args)
        for arm in ("off", "on"):
            llm = LLM(dataclasses.replace(config, prefix_cache=arm))
            try:
                llm.engine.generate([llm.encode_prompt("Say hi.")],
                                    SamplingParams(temperature=0, max_tokens=4))  # warm-up
                for i, r in enumerate(conversation(llm, args.turns, args.max_tokens), 1):
                    acceptance = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
                    texts.setdefault(i, r["text"])
                    rows.append([f"prefix cache {arm}", str(i), str(r["prompt"]),
                                 str(r["cached"]), f"{r['ttft'] * 1e3:.0f}",
                                 f"{r['decode']:.1f}", acceptance,
                                 "yes" if r["text"] == texts[i] else "NO"])
            finally:
                llm.close()
    except StrataError as e:
        print(f"conversation: error: {e}", file=sys.stderr)
        return 2
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: model={config.model or 'default'} "
          f"devices={','.join(config.devices)} spec={config.spec} turns={args.turns} "
          f"max_tokens={args.max_tokens} block_size={config.block_size}")
    print(markdown_table(["arm", "turn", "prompt tokens", "from the cache", "first token ms",
                          "decode tok/s", "draft acceptance", "same text as off"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
