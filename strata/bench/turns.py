"""The turns workload: a coding agent's conversation, re-sent whole every turn. Each of N
users keeps its own conversation (turn 1: the edit request on the `--edit-file` file, then
one new request per turn, each after the model's own earlier answer); the users run in
parallel and send each turn together, so turn t's row is N requests of turn t at once.

What users share: only what comes before their tag. Each user's first message starts with
a tag keyed by the run's seed and the user's index, as the other workloads' prompts do, so
a user's turns 2..T can reuse its own earlier turns through a server's prefix cache, but no
user reuses another's file or answers; the chat template's opening (its system prompt) is
the same for all, and so are the keys of every arm of a run (same prompts, same answers).

Per turn: the median over users of prompt tokens, cached prompt tokens
(`usage.prompt_tokens_details.cached_tokens`), first-token time and decode rate."""

from __future__ import annotations

import statistics
import threading
from concurrent.futures import ThreadPoolExecutor

from strata.bench.client import draft_totals, measure, tag
from strata.bench.workloads import TURNS, turn_request


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def conversation(client, model: str, edit_file: str, max_tokens: int, turns: int, key: str,
                 together: threading.Barrier) -> list[dict]:
    """One user's turns in order; each waits at `together` for the other users' same turn,
    so the turns of all users start at once."""
    messages, requests = [], []
    for t in range(1, turns + 1):
        text = turn_request(t, edit_file)
        messages.append({"role": "user", "content": tag(key) + text if t == 1 else text})
        together.wait()
        request = measure(client, model, messages, max_tokens, keep_text=True)
        # NOTE: the model's own answer goes back as the agent would send it, not its tokens:
        # a server whose template or tokenizer renders it differently reuses less.
        messages.append({"role": "assistant", "content": request.pop("text")})
        requests.append(request)
    return requests


def per_turn(users: list[list[dict]]) -> list[dict]:
    """Each turn's requests (one per user) and their medians."""
    out = []
    for t, requests in enumerate(zip(*users, strict=True), 1):
        out.append({"turn": t, "requests": list(requests),
                    **{f"{field}_median": median([r[field] for r in requests])
                       for field in ("prompt_tokens", "cached_tokens", "first_token_s",
                                     "decode_tok_s")},
                    "drafts": draft_totals(list(requests))})
    return out


def conversations(client, model: str, edit_file: str, max_tokens: int, users: int,
                  turns: int, seed: int, on_turn=None) -> dict:
    """N users' conversations of `turns` turns each; `on_turn(t)` is called as turn t
    starts (from one of the users' threads)."""
    counter = iter(range(1, turns + 1))
    together = threading.Barrier(users, action=(lambda: on_turn(next(counter))) if on_turn
                                 else None)
    failures: list[BaseException] = []

    def one(i: int) -> list[dict]:
        try:
            return conversation(client, model, edit_file, max_tokens, turns,
                                f"{seed}:{TURNS}:user{i}", together)
        except threading.BrokenBarrierError:
            raise
        except BaseException as e:
            failures.append(e)  # NOTE: before the abort, so the first failure is reported
            together.abort()    # the other users stop at their next turn
            raise

    pool = ThreadPoolExecutor(users)
    try:
        futures = [pool.submit(one, i) for i in range(users)]
        try:
            done = [f.result() for f in futures]
        except threading.BrokenBarrierError:
            if failures:  # a user failed and the others stopped: its error is the story
                raise failures[0] from None
            raise
    finally:
        # NOTE: no waiting on an error or Ctrl-C: the streams end when the client is closed.
        together.abort()
        pool.shutdown(wait=False, cancel_futures=True)
    return {"users": users, "turns": per_turn(done)}
