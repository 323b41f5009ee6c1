"""One fresh `strata serve` process per arm: started on a free loopback port in its own
process group (several at once where the bench interleaves its arms, each then waited
for), logging to a file, ready once `/health` answers 200, and always stopped
(SIGTERM, then SIGKILL after a grace period) — on success, on errors and on Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from strata.errors import StrataError

STOP_GRACE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (stage processes included), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    # NOTE: the group may outlive its leader (a stage process): kill what is left of it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise StrataError(f"the server exited with status {proc.returncode} before it was "
                              f"ready; the end of its log {log}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise StrataError(f"the server did not answer /health 200 within {timeout:.0f} s "
                              f"(--start-timeout); the end of its log {log}:\n{log_tail(log)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)


@dataclass(frozen=True)
class Server:
    proc: subprocess.Popen
    base: str  # its base URL (no /v1)
    log: Path


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[Server]:
    """Starts `strata serve ARGV` and yields at once (it is not ready yet: `wait_healthy`);
    stops it when the block ends."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "strata.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), *argv],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own group: Ctrl-C reaches us, we stop it
    try:
        yield Server(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop(proc)
