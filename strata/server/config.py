"""ServerConfig: the HTTP side's settings (the engine's are EngineConfig).

The API key may also come from a file (--api-key-file) or the environment variable
STRATA_API_KEY, so that it does not show in `ps`: `resolve_api_key` picks it up.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from strata.errors import StrataError

API_KEY_ENV = "STRATA_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1 routes (a command line shows in "
                f"ps: prefer --api-key-file or the {API_KEY_ENV} environment variable)"})
    api_key_file: str | None = field(default=None, metadata={
        "help": "read the API key from this file (its first line)"})
    allowed_hosts: tuple[str, ...] = field(default=(), metadata={
        "help": "host names clients may use in the Host header besides the listening "
                "address (and localhost on a loopback or wildcard address); * for any. Other "
                "names get 403, which stops DNS-rebinding attacks from web pages",
        "list_of": str})
    allowed_origins: tuple[str, ...] = field(default=(), metadata={
        "help": "web origins allowed to call the API from a browser (CORS), e.g. "
                "http://localhost:3000; * for any. Other cross-origin requests get 403",
        "list_of": str})
    max_queue: int = field(default=64, metadata={
        "help": "requests that may wait for a slot; beyond it: 429 with Retry-After"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients use (default: the model file or folder name)"})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={
        "help": "largest request body accepted; beyond it: 413"})
    body_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request body may take to arrive; a stalled upload gets 408"})
    sse_keepalive: float = field(default=5.0, metadata={
        "help": "seconds between SSE comment lines to a stream that is waiting (for a "
                "slot, or a long prompt), so proxies and clients keep it open"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "on SIGTERM, seconds running requests may take to finish; then they end "
                "with an error and the server exits"})
    engine_process: str = field(default="auto", metadata={
        "help": "run the engine in a process of its own, so that the server's work "
                "(requests, detokenizing, streaming) never holds up the engine's windows: "
                "auto (on when the model runs on CUDA, where the GPU waits for the host), "
                "on, off (the engine on a thread of the server's process)",
        "choices": ("auto", "on", "off")})
    max_restarts: int = field(default=3, metadata={
        "help": "engine restarts after failures (a stage process died or hung, a load "
                "failed) within 10 minutes; one failure more and the server exits with "
                "status 1 for a supervisor (0: exit on the first failure)"})

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise StrataError(f"--port must be in 1..65535 (got {self.port})")
        if self.max_queue < 0:
            raise StrataError(f"--max-queue must be >= 0 (got {self.max_queue})")
        if self.max_body_bytes < 1024:
            raise StrataError(f"--max-body-bytes must be at least 1024 (got {self.max_body_bytes})")
        if self.api_key is not None and not self.api_key.strip():
            raise StrataError("--api-key is empty; give a key or leave the flag out")
        for name in ("body_timeout", "sse_keepalive", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise StrataError(f"--{name.replace('_', '-')} must be positive "
                                  f"(got {getattr(self, name)})")
        if self.engine_process not in ("auto", "on", "off"):
            raise StrataError(f"--engine-process must be auto, on or off (got "
                              f"{self.engine_process!r})")
        if self.max_restarts < 0:
            raise StrataError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        for origin in self.allowed_origins:
            if origin != "*" and "://" not in origin:
                raise StrataError(f"--allowed-origins: '{origin}' is not an origin; write "
                                  "scheme://host[:port], e.g. http://localhost:3000")

    def runs_engine_process(self, engine_config) -> bool:
        """--engine-process with auto resolved for `engine_config`'s first stage."""
        if self.engine_process == "auto":
            return engine_config.stage_device(0).type == "cuda"
        return self.engine_process == "on"

    @property
    def loopback(self) -> bool:
        return self.host == "localhost" or _is_ip(self.host) and ipaddress.ip_address(
            self.host).is_loopback

    @property
    def wildcard(self) -> bool:
        return self.host in ("", "0.0.0.0", "::")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def resolve_api_key(config: ServerConfig, environ=os.environ) -> ServerConfig:
    """The config with its API key from --api-key, else --api-key-file, else the
    STRATA_API_KEY environment variable (None: no key)."""
    if config.api_key is not None:
        if config.api_key_file is not None:
            raise StrataError("give the API key once: --api-key or --api-key-file, not both")
        return config
    key = None
    if config.api_key_file is not None:
        path = Path(config.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise StrataError(f"--api-key-file {path}: cannot read it "
                              f"({getattr(e, 'strerror', None) or e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise StrataError(f"--api-key-file {path} is empty; write the key on its first line")
    elif environ.get(API_KEY_ENV, "").strip():
        key = environ[API_KEY_ENV].strip()
    return dataclasses.replace(config, api_key=key) if key else config
