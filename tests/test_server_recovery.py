"""A dead stage is seen at once and the server comes back by itself.

- A stage that stopped only because its neighbour vanished (exit code NEIGHBOUR_GONE) is
  never named before the one that died.
- A real server with stage processes: a stage killed while idle turns /health 503 within
  2 s with that one line, then the engine and its stages restart (/health 200 again,
  strata_engine_restarts_total counts it); a stage killed under a stream and a whole
  request ends both with an OpenAI-shaped error that holds no transport detail.
- A model that fails at every load exits non-zero with the reason once --max-restarts is
  spent, instead of answering 503 forever.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from server_utils import free_port, metric, server_process
from strata.pipeline.runner import PipelineRunner
from strata.pipeline.worker import NEIGHBOUR_GONE

ONE_LINE = re.compile(r"^stage 1 \(pid \d+\) exited with code -9$")


class FakeProcess:
    def __init__(self, pid: int, exitcode: int | None):
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None


def test_the_stage_that_died_is_named_before_its_neighbours():
    runner = object.__new__(PipelineRunner)
    runner.processes = [FakeProcess(10, NEIGHBOUR_GONE), FakeProcess(11, -9),
                        FakeProcess(12, NEIGHBOUR_GONE), FakeProcess(13, None)]
    assert runner._dead_stage() == "stage 1 (pid 11) exited with code -9"
    runner.processes = [FakeProcess(10, NEIGHBOUR_GONE), FakeProcess(11, None)]
    assert runner._dead_stage() == f"stage 0 (pid 10) exited with code {NEIGHBOUR_GONE}"
    runner.processes = [FakeProcess(10, None)]
    assert runner._dead_stage() is None


def stage_pids(server_pid: int) -> list[int]:
    """The server's stage processes (spawned by multiprocessing), oldest first."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except OSError:
            continue
        if parent == server_pid and spawned:
            out.append(int(entry))
    return sorted(out)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("recovery") / "serve.log"
    with server_process("--layer-split", "15", "--devices", "cpu,cpu", "--stage-threads", "1",
                        "--parallel", "2", "--max-restarts", "5", log=log) as (base, _, proc):
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        yield base, proc, model, log


def wait_healthy(base: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while httpx.get(f"{base}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the server did not come back"
        time.sleep(0.2)


def test_idle_stage_killed_turns_health_503_at_once_then_the_server_restarts(server):
    base, proc, model, log = server
    stages = stage_pids(proc.pid)
    assert len(stages) == 2
    os.kill(stages[1], signal.SIGKILL)
    start = time.monotonic()
    while (health := httpx.get(f"{base}/health", timeout=5)).status_code == 200:
        assert time.monotonic() - start < 2, "a dead stage was not noticed within 2 s"
        time.sleep(0.05)
    body = health.json()
    assert body["status"] == "restarting", body
    assert body["error"] == f"stage 1 (pid {stages[1]}) exited with code -9"
    refused = httpx.post(f"{base}/v1/completions", timeout=10, json={
        "model": model, "prompt": [1, 2], "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "stage 1" in refused.json()["error"]["message"]
    wait_healthy(base)
    assert metric(base, "strata_engine_restarts_total") == 1
    assert set(stage_pids(proc.pid)).isdisjoint(stages)  # new stage processes
    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": model, "prompt": "The capital of France is", "max_tokens": 4,
        "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert "the engine is restarting" not in reply.text


def test_requests_in_flight_end_with_an_openai_error_when_a_stage_dies(server):
    base, proc, model, log = server
    wait_healthy(base)
    restarts = metric(base, "strata_engine_restarts_total")
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 3000, "temperature": 0}
    whole = {}
    thread = threading.Thread(target=lambda: whole.update(response=httpx.post(
        f"{base}/v1/completions", json=body, timeout=60)))
    thread.start()
    events = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and not events:
                os.kill(stage_pids(proc.pid)[0], signal.SIGKILL)
            if line.startswith("data: "):
                events.append(line[6:])
    thread.join(60)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503
    assert re.match(r"stage 0 \(pid \d+\) exited with code -9; the engine is restarting$",
                    error["message"]), error
    failed = whole["response"]
    assert failed.status_code == 503 and failed.json()["error"]["message"] == error["message"]
    for text in (error["message"], failed.text, httpx.get(f"{base}/health").text):
        assert not re.search(r"gloo|Connection|\d+\.\d+\.\d+\.\d+:\d+|/\w+/", text), text
    wait_healthy(base)
    assert metric(base, "strata_engine_restarts_total") == restarts + 1


def test_a_model_that_never_loads_exits_non_zero_with_the_reason(tiny_models, tmp_path):
    """The tiny checkpoint has no tokenizer: every load fails; after --max-restarts 1 the
    server gives up with status 1 (a supervisor restarts it), /health said why meanwhile."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--model",
         str(tiny_models["llama"][0]), "--max-restarts", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline
            try:
                seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"])
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        stderr = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, stderr
    assert "failed" in seen
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("strata: error: the model failed to load") and "tokenizer.json" in last
    assert "giving up" in last and "Traceback" not in stderr


def test_engine_process_killed_under_a_stream_is_restarted(tmp_path):
    """--engine-process on: SIGKILL the engine's own process (what a crash in a kernel or
    the OOM killer does) under a stream: the stream ends with an OpenAI-shaped 503 naming
    it, /health says so, and a new engine process serves the next request."""
    log = tmp_path / "serve.log"
    with server_process("--engine-process", "on", "--parallel", "2", "--max-context", "512",
                        log=log) as (base, _, proc):
        engines = stage_pids(proc.pid)
        assert len(engines) == 1, "one engine process, spawned by the server"
        model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": "1, 2, 3,", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not events:
                    os.kill(engines[0], signal.SIGKILL)
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and error["message"] == (
            "the engine process exited (signal 9); the engine is restarting"), error
        wait_healthy(base)
        assert metric(base, "strata_engine_restarts_total") == 1
        assert set(stage_pids(proc.pid)).isdisjoint(engines)
        reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in log.read_text()


def test_an_engine_process_that_cannot_load_exits_with_its_reason():
    """The engine process's own load failure (here the scheduler's: a pool smaller than one
    request's context) reaches the server's last line, with no traceback."""
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--engine-process",
         "on", "--kv-tokens", "16", "--max-restarts", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("strata: error: the model failed to load: --kv-tokens 16 holds "
                           "fewer tokens than --max-context"), last
    assert "Traceback" not in proc.stderr
