"""`strata bench --workloads turns` end to end in a subprocess on CPU: two started arms of
the tiny served model (the default model's tokenizer and chat template), the prefix cache
on and off, 2 users x 3 turns of 4-token answers. Each user's prompt grows by its earlier
answer and the next request; with the cache on, turns 2+ read the earlier turns from it,
with it off nothing; the per-arm tables agree with the raw JSON and the other tables are
left out. The conversations' messages and failures are checked with a fake client, the
flags without servers."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace as NS

import pytest
from test_bench import bench, table

from strata.bench.config import Arm, BenchConfig, bench_config
from strata.bench.table import rate, tokens
from strata.bench.turns import conversations
from strata.bench.workloads import TURN_REQUESTS, WORKLOADS, edit_prompt
from strata.errors import StrataError

USERS, TURNS, BLOCK = 2, 3, 16  # BLOCK: the server's default --block-size


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_served_model):
    cwd = tmp_path_factory.mktemp("bench_turns")
    model = f"--model {tiny_served_model} --parallel {USERS}"
    result = bench("--arm", f"cache on={model}", "--arm", f"cache off={model} --prefix-cache off",
                   "--workloads", "turns", "--users", str(USERS), "--turns", str(TURNS),
                   "--max-tokens", "4", "--seed", "5", "--out", "tmp.json", cwd=cwd, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads((cwd / "tmp.json").read_text())


def by_user(arm: dict, field: str) -> list[list]:
    """[user][turn] -> the request's `field`."""
    turns = arm["workloads"]["turns"]["turns"]
    assert [t["turn"] for t in turns] == list(range(1, TURNS + 1))
    return [[t["requests"][u][field] for t in turns] for u in range(USERS)]


def test_prompts_grow_by_the_answer_and_the_next_request(run):
    _, raw = run
    on, off = raw["arms"]
    for arm in (on, off):
        prompts, answers = by_user(arm, "prompt_tokens"), by_user(arm, "completion_tokens")
        for user_prompts, user_answers in zip(prompts, answers, strict=True):
            assert user_answers == [4] * TURNS  # the tiny model never ends early
            for t in range(1, TURNS):  # the answer (re-tokenized) and a request's ~10 tokens
                assert user_prompts[t] >= user_prompts[t - 1] + 10, user_prompts
    # same seed, greedy: both arms sent the same conversations
    assert by_user(on, "prompt_tokens") == by_user(off, "prompt_tokens")


def test_turns_after_the_first_are_read_from_the_prefix_cache(run):
    _, raw = run
    on, off = raw["arms"]
    for prompts, cached in zip(by_user(on, "prompt_tokens"), by_user(on, "cached_tokens"),
                               strict=True):
        # turn 1 shares only the chat template's opening with the warm-up and the other user
        assert cached[0] < 2 * BLOCK, cached
        for t in range(1, TURNS):  # every full block of the previous turn's prompt, at least
            assert prompts[t - 1] - BLOCK <= cached[t] < prompts[t], (prompts, cached)
    assert by_user(off, "cached_tokens") == [[0] * TURNS] * USERS


def test_one_table_per_arm_agrees_with_json(run):
    result, raw = run
    assert "| tok/s |" not in result.stdout and "draft acceptance" not in result.stdout
    assert f"users={USERS} turns={TURNS} " in result.stdout
    for arm in raw["arms"]:
        rows = table(result.stdout, f"turn: {arm['name']}, median of {USERS} users")
        turns = arm["workloads"]["turns"]["turns"]
        assert list(rows) == [str(t) for t in range(1, TURNS + 1)]
        for t in turns:
            prompt, cached, first_ms, decode = rows[str(t["turn"])]
            assert prompt == tokens(t["prompt_tokens_median"])
            assert cached == tokens(t["cached_tokens_median"])
            assert first_ms == f"{t['first_token_s_median'] * 1e3:.0f}"
            assert decode == rate(t["decode_tok_s_median"])
            assert all(r["first_token_s"] > 0 for r in t["requests"])
    assert f"[2/2] cache off: turns, turn {TURNS}/{TURNS} ({USERS} conversations)" \
        in result.stderr


class FakeClient:
    """Answers every request with 'answer N' (N counts requests), and its usage."""

    def __init__(self, fail_at: int | None = None):
        self.sent: list[list[dict]] = []
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.chat = self.completions = self

    def create(self, messages, **_):
        with self.lock:
            self.sent.append([dict(m) for m in messages])
            count = len(self.sent)
        if count == self.fail_at:
            raise RuntimeError("the server went away")
        usage = NS(completion_tokens=2, prompt_tokens=len(messages), model_extra={},
                   prompt_tokens_details=NS(cached_tokens=0))
        return [NS(choices=[NS(delta=NS(content=f"answer {count}"))], usage=None),
                NS(choices=[], usage=usage)]


def test_each_user_keeps_its_own_conversation():
    client = FakeClient()
    started = []
    result = conversations(client, "m", "small", 8, 3, 4, seed=7, on_turn=started.append)
    assert started == [1, 2, 3, 4] and len(client.sent) == 12 and len(result["turns"]) == 4
    assert [len(t["requests"]) for t in result["turns"]] == [3, 3, 3, 3]
    firsts = {sent[0]["content"] for sent in client.sent}
    assert len(firsts) == 3  # one tag per user, the same through its turns
    for first in firsts:
        assert first.endswith(edit_prompt("small")) and first.startswith("[")
        mine = sorted((s for s in client.sent if s[0]["content"] == first), key=len)
        assert [len(s) for s in mine] == [1, 3, 5, 7]
        for t, sent in enumerate(mine[1:], 1):
            assert sent[:-2] == mine[t - 1]  # the whole conversation before, re-sent
            assert sent[-2]["role"] == "assistant" and sent[-2]["content"].startswith("answer")
            assert sent[-1] == {"role": "user", "content": TURN_REQUESTS[t - 1]}
    again = FakeClient()
    conversations(again, "m", "small", 8, 3, 4, seed=7)
    assert {s[0]["content"] for s in again.sent} == firsts  # every arm of a run: the same
    other = FakeClient()
    conversations(other, "m", "small", 8, 3, 4, seed=8)
    assert not {s[0]["content"] for s in other.sent} & firsts


def test_a_failing_user_stops_the_others_and_its_error_is_raised():
    client = FakeClient(fail_at=5)  # on turn 2
    with pytest.raises(RuntimeError, match="went away"):
        conversations(client, "m", "small", 8, 3, 4, seed=7)
    assert len(client.sent) <= 6  # no user got to turn 3


def test_turns_runs_only_when_named():
    assert BenchConfig(arms=(Arm("a", ""),)).workloads == WORKLOADS
    assert "turns" not in WORKLOADS
    config = bench_config(["a="], None, None, None, "edit,turns", turns=6)
    assert config.workloads == ("edit", "turns") and config.turns == 6


@pytest.mark.parametrize("workloads, settings, needle", [
    ("turns", {"turns": 1}, "--turns must be at least 2"),
    ("turns", {"plot": "speed.png"}, "--plot"),
    ("turn", {}, "turns"),
])
def test_bad_turns_settings(workloads, settings, needle):
    with pytest.raises(StrataError, match=needle):
        bench_config(["a="], None, None, None, workloads, **settings)
