"""`strata bench` end to end in a subprocess on CPU: two started arms of a tiny random model,
short answers; the printed tables agree with the raw JSON, every arm and workload is there,
and no server outlives the run. Bad flags end in one line and exit 2; `--plot` draws a PNG or names
`pip install matplotlib`. Table labelling of simulated arms is checked without servers."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import httpx
import pytest

from strata.bench.config import Arm, parse_arm
from strata.bench.table import acceptance_table, busy_cell, speed_table
from strata.errors import StrataError

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
NUMBER = r"(\d+(?:\.\d)?|-)"
CELL = re.compile(rf"^{NUMBER} / {NUMBER} \({NUMBER}-{NUMBER} each\)$")


def bench(*args: str, cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli", "bench", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def table(stdout: str, first_header: str) -> dict[str, list[str]]:
    """{row label: cells} of the markdown table whose header starts with `first_header`."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def agrees(text: str, value: float | None) -> bool:
    """A printed rate is the JSON value rounded: whole from 10 up, one decimal below."""
    if value is None:
        return text == "-"
    decimals = 0 if value >= 10 else 1
    return text == f"{value:.{decimals}f}"


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_served_model):
    cwd = tmp_path_factory.mktemp("bench")
    plot = ["--plot", "speed.png"] if HAS_MATPLOTLIB else []
    model = f"--model {tiny_served_model}"
    result = bench("--arm", f"no drafts=--spec 0 --parallel 2 {model}", "--arm",
                   f"drafts=--parallel 2 {model}", "--workloads", "edit,prose", "--users", "2",
                   "--max-tokens", "16", "--out", "tmp.json", *plot, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads((cwd / "tmp.json").read_text()), cwd


def test_speed_table_agrees_with_json(run):
    result, raw, _ = run
    rows = table(result.stdout, "tok/s")
    assert list(rows) == ["no drafts", "drafts"] == [a["name"] for a in raw["arms"]]
    assert raw["settings"]["workloads"] == ["edit", "prose"]
    for arm in raw["arms"]:
        assert set(arm["workloads"]) == {"edit", "prose"} and not arm["simulated"]
        for cell, name in zip(rows[arm["name"]], ["edit", "prose"], strict=True):
            solo, many = arm["workloads"][name]["solo"], arm["workloads"][name]["concurrent"]
            match = CELL.match(cell)
            assert match, cell
            values = (solo["decode_tok_s"], many["total_tok_s"], many["stream_tok_s_min"],
                      many["stream_tok_s_max"])
            assert all(agrees(t, v) for t, v in zip(match.groups(), values, strict=True)), \
                (cell, values)
            assert len(solo["requests"]) == 2 and len(many["requests"]) == 2
            assert 1 < sum(r["completion_tokens"] for r in many["requests"]) <= 32
            assert many["total_tok_s"] == pytest.approx(many["completion_tokens"] / many["wall_s"])
            assert solo["decode_tok_s"] == pytest.approx(
                sum(r["decode_tok_s"] for r in solo["requests"]) / 2)


def test_header_and_acceptance_table(run):
    result, raw, _ = run
    assert "| tok/s | edit: 1 user / 2 users | prose: 1 user / 2 users |" in result.stdout
    assert f"commit: {raw['commit']}" in result.stdout and "machine: " in result.stdout
    assert "arm no drafts: strata serve --spec 0 --parallel 2" in result.stdout
    assert "simulated" not in result.stdout
    rows = table(result.stdout, "draft acceptance, 1 user")
    off, on = raw["arms"]
    assert rows["no drafts"] == ["-", "-"]
    assert all(off["workloads"][w]["solo"]["drafts"]["drafted"] == 0 for w in ("edit", "prose"))
    assert on["workloads"]["edit"]["solo"]["drafts"]["drafted"] > 0  # a random model repeats itself
    for cell, name in zip(rows["drafts"], ["edit", "prose"], strict=True):
        d = on["workloads"][name]["solo"]["drafts"]
        assert cell == (f"{d['acceptance']:.0%} ({d['accepted']}/{d['drafted']})"
                        if d["drafted"] else "-")


def test_stage_busy_table_agrees_with_json(run):
    result, raw, _ = run
    rows = table(result.stdout, "stage busy fraction, 1 user / 2 users")
    for arm in raw["arms"]:
        for cell, name in zip(rows[arm["name"]], ["edit", "prose"], strict=True):
            parts = [arm["workloads"][name][p] for p in ("solo", "concurrent")]
            assert cell == " / ".join(busy_cell(p) for p in parts)
            for part in parts:  # one stage in one process, then the scheduler
                stage, scheduler = part["stage_busy"]
                assert 0 < stage <= 1.05 and 0 < scheduler < 1


class FakeClient:
    """Records each request's user message; answers with one chunk and its usage."""

    def __init__(self):
        self.texts: list[str] = []
        self.chat = self.completions = self

    def create(self, messages, **_):
        from types import SimpleNamespace as NS
        self.texts.append(messages[0]["content"])
        usage = NS(completion_tokens=1, model_extra={})
        return [NS(choices=[NS(delta=NS(content="x"))], usage=None),
                NS(choices=[], usage=usage)]


def test_every_arm_of_a_run_sends_the_same_prompts_and_no_prompt_repeats():
    from strata.bench.client import concurrent, solo

    def sent(seed: int) -> list[str]:
        client = FakeClient()
        for name in ("edit", "prose"):
            solo(client, "m", name, "small", 4, seed)
            concurrent(client, "m", name, "small", 4, 3, seed)
        return client.texts

    first = sent(7)
    assert len(first) == 10 and len({t.split("]")[0] for t in first}) == 10  # fresh tags
    assert sorted(sent(7)) == sorted(first)  # another arm of the run (threads reorder)
    assert not set(sent(8)) & set(first)     # another run


def test_the_runs_seed_is_recorded_and_paired_arms_answer_alike(run):
    result, raw, _ = run
    seed = raw["settings"]["seed"]
    assert isinstance(seed, int) and f"seed={seed}" in result.stdout
    off, on = raw["arms"]
    for name in ("edit", "prose"):  # greedy, the same prompts: the same answers' lengths
        for part in ("solo", "concurrent"):
            assert sorted(r["completion_tokens"] for r in off["workloads"][name][part]["requests"]) \
                == sorted(r["completion_tokens"] for r in on["workloads"][name][part]["requests"])


def test_busy_seconds_reads_the_servers_counters(monkeypatch):
    from strata.bench import stages
    from strata.server.metrics import Metrics

    metrics = Metrics()
    metrics.observe_stages([1.5, 0.25], 0.5)
    metrics.observe_stages([2.0, 0.25], 0.75)
    monkeypatch.setattr(stages.httpx, "get", lambda url, timeout: httpx.Response(
        200, text=metrics.render().decode(), request=httpx.Request("GET", url)))
    assert stages.busy_seconds("http://x/v1") == [2.0, 0.25, 0.75]


def test_no_server_left_behind(run):
    result, raw, _ = run
    for arm in raw["arms"]:
        log = open(arm["server_log"]).read()
        port = re.search(r"on http://127\.0\.0\.1:(\d+)", log).group(1)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert "[2/2] drafts: prose, 2 users" in result.stderr  # the progress lines


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_writes_png(run):
    assert (run[2] / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed")
def test_plot_without_matplotlib_fails_before_serving(tmp_path):
    result = bench("--arm", "a=", "--plot", "speed.png", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "pip install matplotlib" in result.stderr and not result.stdout


@pytest.mark.parametrize("args, needle", [
    ([], "--arm"),
    (["--arm", "no-equals-sign"], "NAME="),
    (["--arm", "a=--spec 0", "--workloads", "edit,poetry"], "poetry"),
    (["--arm", "a=", "--edit-file", "enormous"], "--edit-file"),
    (["--arm", "a=--port 9000"], "--port"),
    (["--arm", "a=", "--arm", "a=--spec 0"], "differ"),
    (["--arm", "a=", "--users", "0"], "--users"),
    (["--arm", "a=", "--seed", "-1"], "--seed must be >= 0"),
    (["--url", "127.0.0.1:8000"], "http"),
])
def test_bad_flags_one_line_exit_2(tmp_path, args, needle):
    result = bench(*args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("strata: error:") and needle in result.stderr
    assert not (tmp_path / "bench-results.json").exists()


def test_arm_flags():
    arm = parse_arm("sim = --parallel 4 --simulate-acceptance 0.8 --api-key 'sk x'")
    assert arm.name == "sim" and arm.simulated and arm.serve_api_key() == "sk x"
    assert parse_arm("x=--simulate-acceptance=0.5").simulated
    assert not parse_arm("plain=").simulated and parse_arm("plain=").argv == []
    with pytest.raises(StrataError):
        parse_arm("=--spec 0")


def test_simulated_arm_is_labelled():
    def arm(name: str, simulated: bool, drafts) -> dict:
        w = {"solo": {"decode_tok_s": 139.4, "drafts": drafts},
             "concurrent": {"total_tok_s": 209.0, "stream_tok_s_min": 56.2,
                            "stream_tok_s_max": 61.6}}
        return {"name": name, "simulated": simulated, "workloads": {"code": w}}
    results = {"settings": {"workloads": ["code"], "users": 4},
               "arms": [arm("real", False, None),
                        arm("sim", Arm("sim", "--simulate-acceptance 0.9").simulated,
                            {"drafted": 200, "accepted": 180, "acceptance": 0.9})]}
    assert speed_table(results).splitlines()[2:] == [
        "| real | 139 / 209 (56-62 each) |", "| sim (simulated) | 139 / 209 (56-62 each) |"]
    assert acceptance_table(results).splitlines()[2:] == [
        "| real | - |", "| sim (simulated) | 90% (180/200) |"]


def test_the_busy_table_shows_each_stages_expert_hit_rate(monkeypatch):
    """--experts-in-ram: the server's expert read counters, over a measurement, become
    each stage's hit rate in the busy table."""
    from strata.bench import stages
    from strata.experts.cache import ExpertStats
    from strata.server.metrics import Metrics

    metrics = Metrics()
    metrics.observe_stages([1.0, 1.0], 0.5)
    metrics.observe_experts([ExpertStats(hits=10, misses=10), ExpertStats(hits=5, misses=0)])
    monkeypatch.setattr(stages.httpx, "get", lambda url, timeout: httpx.Response(
        200, text=metrics.render().decode(), request=httpx.Request("GET", url)))
    with stages.BusyMeter("http://x/v1") as meter:
        metrics.observe_stages([2.0, 1.5], 0.75)
        metrics.observe_experts([ExpertStats(hits=19, misses=11),
                                 ExpertStats(hits=5, misses=0)])
    assert meter.expert_hits == [0.9, 1.0]
    cell = busy_cell({"stage_busy": [0.5, 0.25, 0.1], "expert_hits": meter.expert_hits})
    assert cell == "0.50 0.25 (sched 0.10; experts 90% 100%)"
    metrics.observe_experts([ExpertStats(hits=19, misses=11, upload_seconds=2.0,
                                         exposed_seconds=0.5, prefetched=4, prefetch_used=3,
                                         predicted_hits=6, predicted_reads=8),
                             ExpertStats(hits=5, misses=0)])
    text = metrics.render().decode()
    for line in ('strata_expert_upload_seconds_total{stage="0"} 2.0',
                 'strata_expert_exposed_seconds_total{stage="0"} 0.5',
                 'strata_expert_prefetch_total{result="uploaded",stage="0"} 4.0',
                 'strata_expert_prefetch_total{result="read",stage="0"} 3.0',
                 'strata_expert_predicted_total{result="hit",stage="0"} 6.0',
                 'strata_expert_predicted_total{result="read",stage="0"} 8.0'):
        assert line in text, line
    with stages.BusyMeter("http://x/v1") as meter:
        metrics.observe_experts([ExpertStats(hits=38, misses=12, upload_bytes=2 * 2**20,
                                             upload_seconds=2.0, exposed_seconds=0.75,
                                             prefetched=4, prefetch_used=3,
                                             predicted_hits=6, predicted_reads=8),
                                 ExpertStats(hits=6, misses=0, upload_bytes=2**20)])
    assert meter.expert_upload == [2 * 2**20, 2**20] and meter.expert_exposed == [0.25, 0.0]
    cell = busy_cell({"stage_busy": [0.5, 0.25, 0.1], "expert_hits": meter.expert_hits,
                      "expert_upload": meter.expert_upload,
                      "expert_exposed": meter.expert_exposed,
                      "requests": [{"completion_tokens": 1}, {"completion_tokens": 3}]})
    assert cell == ("0.50 0.25 (sched 0.10; experts 95% 100%, 0.5 0.2 MiB/token uploaded, "
                    "0.25 0.00 s exposed)")
