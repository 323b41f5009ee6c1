"""Stage processes and pipelined groups (gloo between CPU processes): greedy output equals
one process without drafts; in-process stages equal stage processes; a dead or hung stage
fails the engine within seconds and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from conftest import build_tiny, prompts
from server_utils import free_port
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.errors import StrataError
from strata.llm import LLM
from strata.pipeline import worker
from strata.pipeline.runner import StageFailure
from strata.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts with repeats, so suffix and lookup drafts get accepted and rejected."""
    out = []
    for i, p in enumerate(prompts(4, vocab, seed=11, low=6, high=14)):
        out.append(p * (2 + i % 2) + p[: 3 + i])
    return out


def stage_pids(engine: Engine) -> list[int]:
    pids = [p.pid for p in engine.runner.processes]
    assert len(pids) == engine.runner.num_stages  # one process per stage, none missing
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ")[1].startswith("Z"))


def wait_gone(pids: list[int], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes left behind: {pids}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Greedy outputs of one process without drafts, per model kind."""
    out = {}
    for kind in ("llama", "qwen3_moe"):
        folder = tiny_models[kind][0]
        engine = Engine(EngineConfig(model=str(folder), parallel=4, spec=0))
        out[kind] = engine.generate(repetitive_prompts(320), GREEDY)
    return out


@pytest.mark.parametrize("kind,split", [("llama", (2,)), ("llama", (1, 2, 3)),
                                        ("qwen3_moe", (1, 3))])
def test_stage_processes_with_drafts_equal_one_process_without(tiny_models, reference, kind,
                                                               split):
    config = EngineConfig(model=str(tiny_models[kind][0]), parallel=4, layer_split=split,
                          devices=("cpu",) * (len(split) + 1), stage_threads=1)
    engine = Engine(config)
    try:
        assert engine.scheduler.num_groups == len(split) + 1  # auto: one group per stage
        assert engine.generate(repetitive_prompts(320), GREEDY) == reference[kind]
        stats = engine.draft_stats
        assert stats.accepted > 0 and stats.drafted > stats.accepted  # kept and rejected
        assert all(s > 0 for s in engine.stage_seconds)
        pids = stage_pids(engine)
    finally:
        engine.close()
    wait_gone(pids)


def test_in_process_stages_equal_stage_processes(tiny_models):
    folder = str(tiny_models["llama"][0])
    runs = []
    for devices in (("cpu",), ("cpu", "cpu", "cpu")):
        engine = Engine(EngineConfig(model=folder, parallel=4, layer_split=(1, 3),
                                     devices=devices, batch_groups=2, stage_threads=1,
                                     max_window_tokens=16))  # prompts over several windows
        try:
            ids = repetitive_prompts(320)[1]
            logits = engine.score(ids)
            tokens = engine.generate(repetitive_prompts(320), GREEDY)
            seeded = engine.generate(repetitive_prompts(320)[:2], SamplingParams(
                temperature=0.9, seed=7, max_tokens=20))
            runs.append((logits, tokens, seeded, engine.draft_stats.as_dict()))
        finally:
            engine.close()
    (l1, t1, s1, d1), (l2, t2, s2, d2) = runs
    assert l1.shape == (len(repetitive_prompts(320)[1]), 320)
    assert (l1 - l2).abs().max() < 1e-5
    assert t1 == t2 and s1 == s2 and d1 == d2


@pytest.mark.parametrize("groups", [1, 3])
def test_any_group_count_in_one_process_keeps_greedy_output(tiny_models, reference, groups):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), parallel=4,
                                 layer_split=(2,), batch_groups=groups))
    assert engine.generate(repetitive_prompts(320), GREEDY) == reference["llama"]
    assert engine.draft_stats.accepted > 0


def run_until_failure(engine: Engine, hurt) -> float:
    for p in repetitive_prompts(320):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=400))
    for _ in range(6):
        engine.step()
    hurt()
    start = time.monotonic()
    with pytest.raises(StageFailure) as failure:
        while engine.has_work:
            engine.step()
    return time.monotonic() - start, str(failure.value)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_hung_stage_fails_fast_and_leaves_no_process(tiny_models, sig):
    engine = Engine(EngineConfig(model=str(tiny_models["llama"][0]), parallel=4,
                                 layer_split=(1, 2, 3), devices=("cpu",) * 4, stage_threads=1,
                                 stage_timeout=2))
    try:
        pids = stage_pids(engine)
        seconds, message = run_until_failure(engine, lambda: os.kill(pids[1], sig))
        # NOTE: the bounds are seconds, not minutes, with room for a loaded machine; which
        # check noticed the failure (the exit or --stage-timeout) the message says.
        if sig == signal.SIGKILL:
            assert seconds < 10 and "stage 1" in message and "exited" in message
        else:
            assert seconds < 15 and "hung" in message and "--stage-timeout" in message
        wait_gone(pids)
        assert engine.has_work
        with pytest.raises(StageFailure, match="stopped"):
            engine.step()
    finally:
        engine.close()  # NOTE: an engine left running would fail every later pipelined test


def checkpoint_that_fails_to_load(folder: Path) -> Path:
    """A tiny llama whose layer 0 has an MLP tensor of the wrong shape: stage 0 (layers
    0 and 1) cannot load it, the other stages load."""
    model = build_tiny("llama", folder)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()
               if name != "lm_head.weight"}  # tied to the embedding
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(100, 64)  # config: 96 rows
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_stage_load_error_names_the_tensor(tmp_path):
    folder = checkpoint_that_fails_to_load(tmp_path / "bad")
    with pytest.raises(StrataError, match="stage 0 could not load.*mlp.*shape"):
        Engine(EngineConfig(model=str(folder), layer_split=(2,), devices=("cpu", "cpu"),
                            stage_threads=1))


def stage_1_loads_late(host: str, port: int, world_size: int, rank: int) -> None:
    """A stage process (the engine's, swapped in below) that exits as soon as its load
    error is stored, while stage 1 (rank 2) has not begun to load."""
    worker.REPORT_SECONDS = 0
    if rank == 2:
        time.sleep(60)  # until the engine stops it
    worker.stage_process_main(host, port, world_size, rank)


def test_load_error_wins_over_the_exit_that_follows_it(tmp_path, monkeypatch):
    """Stage 0 reports its load error and exits while stage 1 is still loading: the engine
    reports the error, not that stage 0 exited, and stops stage 1."""
    folder = checkpoint_that_fails_to_load(tmp_path / "bad")
    monkeypatch.setattr("strata.pipeline.runner.stage_process_main", stage_1_loads_late)
    with pytest.raises(StrataError, match="stage 0 could not load.*mlp.*shape"):
        Engine(EngineConfig(model=str(folder), layer_split=(2,), devices=("cpu", "cpu"),
                            stage_threads=1))
    assert stage_processes(os.getpid()) == []


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def stage_processes(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned: stage processes (not its
    resource tracker)."""
    out = []
    for child in children(pid):
        try:
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                out.append(child)
        except OSError:
            continue  # it exited
    return out


def start_server(model: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`strata serve` with two stage processes."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--model",
             str(model), "--layer-split", "2", "--devices", "cpu,cpu", "--stage-threads", "1",
             *flags], stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                if health.status_code == 200:
                    return proc, base
                assert health.json()["status"] == "loading", log.read_text()
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def served_model(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]


def test_server_with_a_killed_stage_errors_and_answers_503(tiny_served_model, tmp_path):
    # NOTE: one token per window (no drafts): the answer outlasts the moment of the kill
    proc, base = start_server(tiny_served_model, tmp_path / "server.log", "--spec", "0")
    try:
        stages = stage_processes(proc.pid)
        assert len(stages) == 2
        body = {"model": served_model(base), "prompt": [1, 2, 3, 4], "max_tokens": 2000,
                "temperature": 0, "stream": True}
        start = None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and start is None:
                    for pid in stages:
                        os.kill(pid, signal.SIGKILL)
                    start = time.monotonic()
                if "error" in line:
                    assert start is not None, line
                    break
            else:
                pytest.fail("the stream ended without an error")
        # NOTE: well under --stage-timeout (20 s): the exits themselves were noticed
        assert time.monotonic() - start < 10
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and "stage" in health.json()["error"]
        refused = httpx.post(f"{base}/v1/completions", json={**body, "stream": False},
                             timeout=10)
        assert refused.status_code == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    wait_gone(stages)


def test_sigterm_stops_the_server_and_its_stages(tiny_served_model, tmp_path):
    proc, base = start_server(tiny_served_model, tmp_path / "server.log")
    stages = stage_processes(proc.pid)
    assert len(stages) == 2
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": served_model(base), "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    wait_gone(stages)


def test_server_killed_with_sigkill_leaves_no_stage(tiny_served_model, tmp_path):
    proc, _ = start_server(tiny_served_model, tmp_path / "server.log")
    stages = stage_processes(proc.pid)
    assert len(stages) == 2
    proc.kill()
    proc.wait()
    wait_gone(stages, seconds=5)  # each stage watches its parent


def test_torchrun_runs_the_same_stages(tiny_served_model):
    llm = LLM(EngineConfig(model=str(tiny_served_model)))  # one process
    one = "".join(llm.stream(llm.encode_prompt("The cat sat"),
                             SamplingParams(temperature=0, max_tokens=12)))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "strata.cli", "generate", "The cat sat", "--model", str(tiny_served_model),
         "--max-tokens", "12", "--temperature", "0", "--layer-split", "1,3", "--devices",
         "cpu,cpu,cpu", "--stage-threads", "1"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == one + "\n" and one.strip()  # `strata generate` ends with a newline


def test_server_whose_model_fails_to_load_starts_no_stage(tiny_models, tmp_path):
    """The tiny checkpoint has no tokenizer: the server reports it and keeps no stage alive."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--model",
             str(tiny_models["llama"][0]), "--layer-split", "2", "--devices", "cpu,cpu"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if health.json()["status"] == "failed":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert "tokenizer.json" in health.json()["error"]
        assert stage_processes(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
