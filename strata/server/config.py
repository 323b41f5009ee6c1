"""ServerConfig: the HTTP side's settings (the engine's are EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import StrataError


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1 routes"})
    max_queue: int = field(default=64, metadata={
        "help": "requests that may wait for a slot; beyond it: 429 with Retry-After"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients use (default: the model file or folder name)"})
    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata={
        "help": "largest request body accepted; beyond it: 413"})

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise StrataError(f"--port must be in 1..65535 (got {self.port})")
        if self.max_queue < 0:
            raise StrataError(f"--max-queue must be >= 0 (got {self.max_queue})")
        if self.max_body_bytes < 1024:
            raise StrataError(f"--max-body-bytes must be at least 1024 (got {self.max_body_bytes})")
        if self.api_key is not None and not self.api_key.strip():
            raise StrataError("--api-key is empty; give a key or leave the flag out")
