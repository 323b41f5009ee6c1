"""A coding agent's conversation, turn by turn, with and without the prefix cache: each
turn's prompt is the whole conversation so far (the file, every earlier request and
answer) plus a new request, as agents send it. Four arms:

- `off`: every prompt computed whole (--prefix-cache off);
- `on`: the prefix cache, the conversation's blocks staying on the device;
- `on, evicted`: a pool of one --max-context (--kv-tokens) and, before each later turn,
  another agent's prompt that needs the whole pool, so the blocks are gone: computed again;
- `on, evicted, host RAM`: the same with --conversation-cache-mib: copied back instead.

Prints per turn and arm the prompt length, the prompt tokens not computed (from the device
cache or host RAM) and those copied back from host RAM, the time to first token, the
decode rate, draft acceptance and whether the text equals the `off` arm's (greedy), with
machine, commit and settings.

    .venv/bin/python benchmarks/conversation.py                          # default model, CPU
    .venv/bin/python benchmarks/conversation.py --devices cuda:0 --edit-file large \
        --max-tokens 1000                                  # grows to ~6,000 tokens

The requests run one at a time through the engine in this process (no server); the turns'
requests are the `turns` workload's (strata/bench/workloads.py), which `strata bench
--workloads turns` sends to servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from strata.bench.report import commit, machine, markdown_table
from strata.bench.workloads import EDIT_FILES, turn_request
from strata.cli import add_engine_flags, engine_config
from strata.errors import StrataError
from strata.llm import LLM
from strata.sampling.params import SamplingParams

HOST_MIB = 4096  # the host-RAM arm's --conversation-cache-mib


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


def conversation(llm: LLM, turns: int, max_tokens: int, edit_file: str,
                 other: list[int] | None) -> list[dict]:
    """The turns in order; `other`: another agent's prompt run before each later turn."""
    messages, out = [], []
    host = llm.engine.scheduler.pool.host
    for i in range(1, turns + 1):
        if other is not None and i > 1:
            llm.engine.generate([other], SamplingParams(temperature=0, max_tokens=1))
        restored = host.restored_blocks if host is not None else 0
        messages.append({"role": "user", "content": turn_request(i, edit_file)})
        result = turn(llm, messages, max_tokens)
        result["restored"] = ((host.restored_blocks - restored) * llm.engine.config.block_size
                              if host is not None else 0)
        out.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return out


def arms(config) -> list[tuple[str, object, bool]]:
    """(name, engine config, whether another agent's prompt runs between turns)."""
    evicted = dataclasses.replace(config, prefix_cache="on", kv_tokens=config.max_context)
    return [("off", dataclasses.replace(config, prefix_cache="off"), False),
            ("on", dataclasses.replace(config, prefix_cache="on"), False),
            ("on, evicted", evicted, True),
            ("on, evicted, host RAM",
             dataclasses.replace(evicted, conversation_cache_mib=HOST_MIB), True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(parser, defaults={"spec_suffix_global": 0, "max_context": 8192})
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--edit-file", choices=sorted(EDIT_FILES), default="small",
                        help="the file the conversation edits (large: ~2,700 tokens)")
    args = parser.parse_args()
    rows, texts = [], {}
    try:
        config = engine_config(args)
        for name, arm, evict in arms(config):
            llm = LLM(arm)
            try:
                llm.engine.generate([llm.encode_prompt("Say hi.")],
                                    SamplingParams(temperature=0, max_tokens=4))  # warm-up
                other = None
                if evict:  # random tokens that fill the pool but for one block
                    g = torch.Generator().manual_seed(0)
                    size = llm.engine.scheduler.pool.num_blocks * arm.block_size
                    other = torch.randint(0, llm.engine.model_config.vocab_size,
                                          (size - 2 * arm.block_size,), generator=g).tolist()
                for i, r in enumerate(conversation(llm, args.turns, args.max_tokens,
                                                   args.edit_file, other), 1):
                    acceptance = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
                    texts.setdefault(i, r["text"])
                    rows.append([name, str(i), str(r["prompt"]), str(r["cached"]),
                                 str(r["restored"]), f"{r['ttft'] * 1e3:.0f}",
                                 f"{r['decode']:.1f}", acceptance,
                                 "yes" if r["text"] == texts[i] else "NO"])
            finally:
                llm.close()
    except StrataError as e:
        print(f"conversation: error: {e}", file=sys.stderr)
        return 2
    print(f"machine: {machine()}\ncommit: {commit()}\nsettings: model={config.model or 'default'} "
          f"devices={','.join(config.devices)} dtype={config.dtype} spec={config.spec} "
          f"turns={args.turns} max_tokens={args.max_tokens} edit_file={args.edit_file} "
          f"block_size={config.block_size} max_context={config.max_context} "
          f"host_mib={HOST_MIB}")
    print(markdown_table(["arm", "turn", "prompt tokens", "not computed", "from host RAM",
                          "first token ms", "decode tok/s", "draft acceptance",
                          "same text as off"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
