"""A stage process: builds and loads its stage, then loops over windows.

Each window: the header from rank 0, the hidden states from the previous stage (stage 0
embeds the header's token ids), this stage's layers, then the hidden states on to the next
stage, or, on the last stage, verification and MTP drafts and the result back to rank 0.
Per window a small float64 table carries every stage's report (compute seconds, expert
cache counts) down the pipe.
The stage decides nothing: the header says where every token goes. It exits when rank 0
says stop, when its parent dies, and when any send or receive fails (a neighbour died:
exit code NEIGHBOUR_GONE, so the engine names the stage that died first, not this one).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from strata.pipeline import rendezvous
from strata.pipeline.transport import HiddenLink, Pending, recv_object, send_object
from strata.stage.results import WindowVerifier
from strata.stage.stage import REPORT, build_stage
from strata.weights.checkpoint import open_checkpoint

log = logging.getLogger("strata.stage")

STOP = "stop"
WINDOW = "window"
NEIGHBOUR_GONE = 3  # exit code: a send or receive failed because another process vanished
REPORT_SECONDS = 5  # a stage that could not load waits this long for rank 0 to report why


class NeighbourGone(Exception):
    """A send or receive failed: a neighbouring process (or the engine) is gone."""


def _transport(call, *args, **kwargs):
    """Run a send or receive; its failure means a neighbour is gone (NeighbourGone)."""
    try:
        return call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - gloo and NCCL raise several kinds
        raise NeighbourGone(str(e)) from e


def default_threads(num_stages: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_stages)


def watch_parent(interval: float = 0.5) -> None:
    """Exit at once if the process that started this one dies (no orphans, even after
    the server was killed with SIGKILL)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="strata-parent-watch", daemon=True).start()


def run_stage(store: dist.Store, rank: int) -> None:
    """The whole life of stage `rank - 1`: load, report ready and serve, or report the
    load error and exit with status 1."""
    plan = rendezvous.read_plan(store)
    index, config = rank - 1, plan.config
    keys = rendezvous.strata_keys(store)
    try:
        torch.set_num_threads(config.stage_threads or default_threads(plan.num_stages))
        checkpoint = open_checkpoint(config.model, config.mtp_model)
        stage = build_stage(config, checkpoint.config, index, plan.cache_size, mtp=plan.mtp)
        stage.load(checkpoint)
        stage.capture_graphs(config)
        last = index == plan.num_stages - 1
        verifier = WindowVerifier(stage, config) if last else None
    except Exception as e:  # noqa: BLE001 - the engine reports it and stops every stage
        name = rendezvous.ready_key(index)
        keys.set(name, f"error: {e}")
        keys.check([name])  # NOTE: a round trip: the store holds the error before this exits
        # NOTE: torchrun ends every process as soon as one fails: wait for rank 0 to report
        # the error (the engine stops its own stage processes at once when it reads it).
        time.sleep(REPORT_SECONDS)
        sys.exit(1)
    keys.set(rendezvous.ready_key(index), "ok")
    if stage.device.type == "cuda":
        torch.cuda.set_device(stage.device)  # NOTE: NCCL binds this process to its GPU
    groups = rendezvous.join_groups(store, rank, plan)
    loop = StageLoop(index, plan, stage, verifier, groups, checkpoint.config.hidden_size)
    loop.serve()  # NOTE: NeighbourGone leaves at once: sends to a vanished peer never end
    loop.pending.wait_all()
    dist.destroy_process_group()


class StageLoop:
    def __init__(self, index: int, plan: rendezvous.Plan, stage, verifier, groups,
                 hidden_size: int):
        self.index, self.stage, self.verifier, self.groups = index, stage, verifier, groups
        self.num_stages = plan.num_stages
        self.rank = index + 1
        self.first, self.last = index == 0, index == plan.num_stages - 1
        self.link = HiddenLink(hidden_size, plan.config.torch_dtype(), stage.device,
                               plan.num_stages, groups.hidden, width=REPORT)
        self.pending = Pending()
        self.cuda = stage.device.type == "cuda"

    def serve(self) -> None:
        with torch.inference_mode():
            while True:
                kind, header = _transport(recv_object, 0)
                if kind == STOP:
                    return
                self.run(header)

    def run(self, header) -> None:
        start = time.perf_counter()
        meta = self.stage.prepare(header)  # NOTE: built while the previous stage works
        prepared = time.perf_counter() - start
        if self.first:
            x = header.token_ids
            seconds = torch.zeros(self.num_stages, REPORT, dtype=torch.float64)
        else:
            x, seconds = _transport(self.link.recv, header.num_tokens, self.rank - 1)
        start = time.perf_counter()
        self.stage.move_blocks(header)
        out = self.stage.forward(x, meta)
        if not self.last:
            if self.cuda:
                torch.cuda.synchronize(self.stage.device)  # NOTE: so that seconds are compute
            seconds[self.index] = torch.tensor(
                self.stage.report(prepared + time.perf_counter() - start))
            _transport(self.link.send, out, seconds, self.rank + 1, self.pending)
            return
        logits, hidden, decided = out
        result = self.verifier.finish(self.verifier.launch(header, logits, hidden,  # host read
                                                           decided))
        seconds[self.index] = torch.tensor(
            self.stage.report(prepared + time.perf_counter() - start))
        result.stage_seconds = seconds[:, 0].tolist()
        if self.stage.offload is not None:  # the engine runs every stage with the flag
            result.expert_stats = seconds[:, 1:].tolist()
        _transport(send_object, result, 0, self.pending, group=self.groups.results)


def stage_process_main(host: str, port: int, world_size: int, rank: int) -> None:
    """Entry of a stage process: started by the engine (multiprocessing, spawn), or by
    torchrun running `strata serve` (every rank but 0 comes here)."""
    watch_parent()
    logging.basicConfig(level=logging.INFO, format=f"strata stage {rank - 1}: %(message)s")
    store = rendezvous.connect_store(rendezvous.Address(host, port, world_size))
    try:
        run_stage(store, rank)
    except NeighbourGone as e:
        log.error("stopped: a neighbouring process is gone (%s)", e)
        sys.stderr.flush()
        os._exit(NEIGHBOUR_GONE)
    except Exception as e:  # noqa: BLE001 - this stage's own failure; the engine names it
        log.exception("stopped: %s", e)
        sys.stderr.flush()
        os._exit(1)
