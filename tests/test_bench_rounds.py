"""`strata bench --rounds N --interleave`: a two-round interleaved run of two started arms
of a tiny random model on CPU — every round in the JSON, each cell the median round's
record whole, the spread table agreeing with the rounds, both servers started together
and the arms taken in turn, the first arm rotating by round and workload, no server left
behind, and a run cut short keeping its finished rounds; the median and rotation rules as
plain functions; bad settings as one line."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_bench import agrees, bench, table

from strata.bench.harness import rotated
from strata.bench.rounds import median_index, median_workloads, spread


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_served_model):
    cwd = tmp_path_factory.mktemp("bench_rounds")
    model = f"--model {tiny_served_model}"
    result = bench("--arm", f"no drafts=--spec 0 --parallel 2 {model}", "--arm",
                   f"drafts=--parallel 2 {model}", "--workloads", "edit,prose", "--users", "2",
                   "--max-tokens", "12", "--rounds", "2", "--interleave", "--out", "tmp.json",
                   cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads((cwd / "tmp.json").read_text())


def test_each_cell_is_the_lower_middle_round_whole(run):
    result, raw = run
    assert raw["settings"]["rounds"] == 2 and raw["settings"]["interleave"]
    assert "rounds=2 interleave" in result.stdout
    for arm in raw["arms"]:
        assert len(arm["rounds"]) == 2 and len(arm["server_logs"]) == 2
        for name in ("edit", "prose"):
            for part, key in (("solo", "decode_tok_s"), ("concurrent", "total_tok_s")):
                cells = [r[name][part] for r in arm["rounds"]]
                lower = min(cells, key=lambda c: c[key])
                assert arm["workloads"][name][part] == lower  # the record, not a mix


def test_spread_table_agrees_with_the_rounds(run):
    result, raw = run
    rows = table(result.stdout, "tok/s over 2 rounds, lowest-highest")
    for arm in raw["arms"]:
        for column, name in enumerate(("edit", "prose")):
            solo, many = rows[arm["name"]][column].split(" / ")
            for text, part, key in ((solo, "solo", "decode_tok_s"),
                                    (many, "concurrent", "total_tok_s")):
                low, high = re.fullmatch(r"([\d.]+)-([\d.]+)", text).groups()
                values = [r[name][part][key] for r in arm["rounds"]]
                assert agrees(low, min(values)) and agrees(high, max(values))


def test_arms_take_turns_with_both_servers_up(run):
    result, _ = run
    lines = [line for line in result.stderr.splitlines() if line.startswith("[round")]
    starts = [i for i, line in enumerate(lines) if "starting strata serve" in line]
    edits = [i for i, line in enumerate(lines) if ": edit, 1 user" in line]
    assert len(starts) == 4 and len(edits) == 4
    # round 1: both servers start before any measurement, then no drafts goes first on
    # edit and second on prose; round 2 starts with the other arm
    assert starts[1] < edits[0] and starts[2] > edits[1] and starts[3] < edits[2]
    warm = [i for i, line in enumerate(lines) if line.endswith(": warm-up")]
    assert starts[1] < warm[0] and starts[3] < warm[2]  # started together, then waited for
    order = [re.search(r"\] (no drafts|drafts): (edit|prose), 1 user", line).groups()
             for line in lines if ", 1 user" in line]
    assert order == [("no drafts", "edit"), ("drafts", "edit"), ("drafts", "prose"),
                     ("no drafts", "prose"), ("drafts", "edit"), ("no drafts", "edit"),
                     ("no drafts", "prose"), ("drafts", "prose")]


def test_no_server_of_any_round_left_behind(run):
    _, raw = run
    for arm in raw["arms"]:
        for log in arm["server_logs"]:
            port = re.search(r"on http://127\.0\.0\.1:(\d+)", open(log).read()).group(1)
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_median_and_rotation_rules():
    assert median_index([5.0]) == 0
    assert median_index([3.0, 1.0, 2.0]) == 2
    assert median_index([4.0, 1.0]) == 1           # even: the lower middle
    assert median_index([None, 7.0, 6.0]) == 2     # unknown ranks lowest
    assert median_index([2.0, 2.0, 2.0]) == 1      # ties by index
    assert rotated([0, 1, 2], 0) == [0, 1, 2] and rotated([0, 1, 2], 4) == [1, 2, 0]

    def cell(solo: float, total: float) -> dict:
        return {"solo": {"decode_tok_s": solo, "tag": solo},
                "concurrent": {"total_tok_s": total, "tag": total}}
    rounds = [{"code": cell(10, 300)}, {"code": cell(30, 100)}, {"code": cell(20, 200)}]
    chosen = median_workloads(rounds)["code"]
    assert chosen["solo"]["tag"] == 20 and chosen["concurrent"]["tag"] == 200
    assert spread(rounds, "code", "concurrent") == (100, 300)
    turns = [{"turns": [{"decode_tok_s_median": v}]} for v in (9.0, 3.0, None)]
    assert median_workloads([{"turns": t} for t in turns])["turns"] is turns[1]


@pytest.mark.parametrize("args, needle", [
    (["--arm", "a=", "--rounds", "0"], "--rounds must be at least 1"),
    (["--arm", "a=", "--interleave"], "two or more arms"),
])
def test_bad_round_settings_one_line_exit_2(tmp_path, args, needle):
    result = bench(*args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_a_run_cut_short_keeps_its_finished_rounds(tmp_path, monkeypatch):
    """--out is written after every round: a failure (or a kill) in round 2 leaves round
    1's numbers on disk."""
    from strata.bench import harness
    from strata.bench.config import BenchConfig, parse_arm
    from strata.errors import StrataError

    def measured(config, round_, log_dir, progress, seed):
        if round_ == 1:
            raise StrataError("arm 'a': the server went away")
        cell = {"solo": {"decode_tok_s": 100.0, "drafts": None}}
        return [{"model": "m", "server_log": None, "workloads": {"edit": cell}}]

    monkeypatch.setattr(harness, "run_round", measured)
    out = tmp_path / "out.json"
    config = BenchConfig(arms=(parse_arm("a="),), workloads=("edit",), users=1, rounds=3,
                         out=str(out))
    with pytest.raises(StrataError, match="went away"):
        harness.run(config)
    raw = json.loads(out.read_text())
    assert raw["rounds_done"] == 1 and raw["settings"]["rounds"] == 3
    arm, = raw["arms"]
    assert len(arm["rounds"]) == 1 and arm["workloads"]["edit"]["solo"]["decode_tok_s"] == 100.0
