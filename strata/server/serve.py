"""`strata serve`: check the model, the devices and the address, then run uvicorn with the
engine loading on its own thread (so /health answers 503 until it is ready).

SIGTERM stops accepting connections, lets running requests finish for --shutdown-timeout
seconds, then ends them with an error. When the engine keeps failing (more than
--max-restarts times in 10 minutes) the server stops and exits with status 1."""

from __future__ import annotations

import logging
import socket
import sys

from strata.config import EngineConfig
from strata.errors import StrataError
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig, resolve_api_key
from strata.server.metrics import Metrics
from strata.stage.runner import check_device
from strata.weights.checkpoint import open_checkpoint


def model_name(checkpoint) -> str:
    name = checkpoint.path.name
    return name[:-5] if name.endswith(".gguf") else name


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StrataError(f"cannot listen on {host}:{port} ({e.strerror}); pass another "
                              "--port or --host") from None


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    import uvicorn

    from strata.server.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    server_config = resolve_api_key(server_config)
    # Bad files, splits and devices fail here, with one line, before the server listens.
    checkpoint = open_checkpoint(engine_config.model, engine_config.mtp_model)
    for stage in range(len(engine_config.stage_ranges(checkpoint.config.num_layers))):
        check_device(engine_config.stage_device(stage))
        engine_config.keeps_quantized(stage)  # raises if the stage cannot run its kernels
    check_port_free(server_config.host, server_config.port)
    name = server_config.served_model_name or model_name(checkpoint)
    metrics = Metrics()
    engine = AsyncEngine(engine_config, checkpoint, metrics, server_config.max_queue,
                         server_config.max_restarts,
                         process=server_config.runs_engine_process(engine_config))
    app = build_app(engine, server_config, name, metrics)
    logging.getLogger("strata.server").info(
        "serving '%s' on http://%s:%d/v1 (loading the model; /health answers 503 until it "
        "is ready)", name, server_config.host, server_config.port)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # NOTE: requests still running after --shutdown-timeout end with an error
            engine.begin_shutdown(server_config.shutdown_timeout)
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level="warning",
        timeout_graceful_shutdown=server_config.shutdown_timeout + 5))

    def give_up(_reason: str) -> None:
        server.should_exit = True

    engine.on_fatal = give_up
    server.run()
    if engine.fatal is not None:
        print(f"strata: error: {engine.fatal}", file=sys.stderr)
        return 1
    return 0
