"""The requests of the protocol, sent with the official `openai` client so that any
OpenAI-compatible server is measured the same way: one streamed chat completion
(`measure`), two sequential ones (`solo`), N at once (`concurrent`); the turns
workload's conversations are in `turns`.

A request's decode rate is (completion tokens - 1) / (last content chunk - first content
chunk): the first token belongs to the prefill, as in the server's log line."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from strata.bench.workloads import workload
from strata.errors import StrataError


def tag(key: str) -> str:
    """`[8 hex chars] `, a hash of `key`: put before a request's first message, it keeps the
    request from sharing a prompt prefix with any request of another key."""
    return f"[{hashlib.sha256(key.encode()).hexdigest()[:8]}] "


def prompt(name: str, edit_file: str, key: str) -> str:
    """The workload's user message behind a tag derived from `key`: a run's keys differ
    per request, so no prefix is reused within an arm, and every arm of the run gets the
    same keys, so arms are compared on the same prompts (and, greedy, the same answers)."""
    return tag(key) + workload(name, edit_file)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def measure(client, model: str, messages: list[dict], max_tokens: int,
            keep_text: bool = False) -> dict:
    """One streamed request: prompt, cached and completion tokens, decode rate, wall and
    first-token time, the server's draft statistics (`usage.drafts`, a Strata extension;
    None elsewhere) and, if `keep_text`, the answer. `cached_tokens` is None where the
    server does not report `usage.prompt_tokens_details`."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_body={"reasoning_effort": "none"})
    first = last = None
    usage = None
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    wall = time.perf_counter() - start
    if usage is None:
        raise StrataError("the server sent no usage chunk although the request asked for "
                          "stream_options.include_usage; its token counts are unknown")
    tokens = usage.completion_tokens
    decode_s = (last - first) if first is not None else 0.0
    details = getattr(usage, "prompt_tokens_details", None)
    drafts = (usage.model_extra or {}).get("drafts")
    out = {"prompt_tokens": getattr(usage, "prompt_tokens", None),
           "cached_tokens": getattr(details, "cached_tokens", None),
           "completion_tokens": tokens,
           "decode_tok_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None,
           "wall_s": wall, "first_token_s": (first - start) if first is not None else None,
           "drafts": drafts}
    if keep_text:
        out["text"] = "".join(pieces)
    return out


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def draft_totals(requests: list[dict]) -> dict | None:
    """Drafted and accepted tokens summed over requests; None if the server reports none."""
    stats = [r["drafts"] for r in requests if r["drafts"] is not None]
    if not stats:
        return None
    drafted = sum(d.get("drafted", 0) for d in stats)
    accepted = sum(d.get("accepted", 0) for d in stats)
    return {"drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "simulated": any(d.get("simulated", False) for d in stats)}


def solo(client, model: str, name: str, edit_file: str, max_tokens: int, seed: int) -> dict:
    """1 user: two sequential requests; the mean of their decode rates."""
    requests = [measure(client, model, user(prompt(name, edit_file, f"{seed}:{name}:solo:{i}")),
                        max_tokens) for i in range(2)]
    return {"requests": requests, "decode_tok_s": mean([r["decode_tok_s"] for r in requests]),
            "drafts": draft_totals(requests)}


def concurrent(client, model: str, name: str, edit_file: str, max_tokens: int,
               users: int, seed: int) -> dict:
    """N users: N requests at once; total completion tokens over the batch's wall time,
    and each stream's own decode rate."""
    texts = [prompt(name, edit_file, f"{seed}:{name}:users{users}:{i}") for i in range(users)]
    ready = threading.Barrier(users + 1)

    def one(text: str) -> dict:
        ready.wait()
        return measure(client, model, user(text), max_tokens)

    pool = ThreadPoolExecutor(users)
    try:
        futures = [pool.submit(one, text) for text in texts]
        ready.wait()  # NOTE: the clock starts when every thread is about to send
        start = time.perf_counter()
        requests = [f.result() for f in futures]
        wall = time.perf_counter() - start
    finally:
        # NOTE: no waiting on an error or Ctrl-C: the streams end when the server is stopped.
        ready.abort()  # frees threads still at the barrier if the main thread never got there
        pool.shutdown(wait=False, cancel_futures=True)
    rates = [r["decode_tok_s"] for r in requests if r["decode_tok_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in requests)
    return {"users": users, "requests": requests, "wall_s": wall, "completion_tokens": tokens,
            "total_tok_s": tokens / wall,
            "stream_tok_s_min": min(rates) if rates else None,
            "stream_tok_s_max": max(rates) if rates else None,
            "drafts": draft_totals(requests)}
