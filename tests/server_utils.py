"""Start a real `strata serve` process on a free loopback port for tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx

from strata.bench.process import free_port  # noqa: F401  (tests import it from here)


@contextlib.contextmanager
def running_server(*flags: str, log: Path, timeout: float = 180):
    """Yields (base_url, statuses seen on /health before it was ready)."""
    with server_process(*flags, log=log, timeout=timeout) as (base, seen, _):
        yield base, seen


@contextlib.contextmanager
def server_process(*flags: str, log: Path, timeout: float = 180):
    """Yields (base_url, statuses seen on /health before it was ready, the Popen)."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port),
                                 *flags], stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    seen = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"server not healthy in time:\n{log.read_text()}"
            try:
                status = httpx.get(f"{base}/health", timeout=2).status_code
                seen.append(status)
                if status == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base, seen, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(base: str, name: str) -> float:
    """Sum of a Prometheus metric's samples whose line starts with `name`."""
    return metric_text(httpx.get(f"{base}/metrics", timeout=5).text, name)


def metric_text(text: str, name: str) -> float:
    """Sum of the samples in Prometheus text whose line starts with `name`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))
