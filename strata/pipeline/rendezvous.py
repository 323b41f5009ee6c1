"""How the processes of one engine find each other: a TCPStore, the plan rank 0 publishes
there, each stage's ready (or error) line, then the process groups.

Self-launched stages (`strata serve --devices cpu,cpu`) use a store that the engine hosts
on 127.0.0.1; under torchrun every process connects to the store of torchrun's agent
(MASTER_ADDR, MASTER_PORT), so the same stages can span machines.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from strata.config import EngineConfig
from strata.kvcache.spec import CacheSize

# NOTE: an idle server's stages wait for the next window in a blocking receive, which
# gloo would end after the process group's timeout; hangs are detected by the engine.
GROUP_TIMEOUT = timedelta(days=3650)
STORE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Plan:
    """What every stage process needs to build its stage: published by rank 0."""
    config: EngineConfig
    cache_size: CacheSize
    mtp: bool
    nccl: bool  # hidden states between stages on NCCL (every stage on its own GPU)

    @property
    def num_stages(self) -> int:
        return len(self.config.layer_split) + 1


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    world_size: int


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def torchrun_address() -> Address:
    return Address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                   int(os.environ["WORLD_SIZE"]))


def host_store() -> dist.TCPStore:
    """A store on a free local port, hosted by this (rank 0) process."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=STORE_TIMEOUT)


def connect_store(address: Address) -> dist.TCPStore:
    return dist.TCPStore(address.host, address.port, is_master=False, timeout=STORE_TIMEOUT)


def strata_keys(store: dist.Store) -> dist.PrefixStore:
    return dist.PrefixStore("strata", store)


def publish_plan(store: dist.Store, plan: Plan) -> None:
    strata_keys(store).set("plan", pickle.dumps(plan))


def read_plan(store: dist.Store) -> Plan:
    return pickle.loads(strata_keys(store).get("plan"))  # waits until rank 0 published it


def ready_key(stage: int) -> str:
    return f"ready/{stage}"


@dataclass
class Groups:
    """The process groups besides the default (gloo, every rank: headers, hidden on CPU)."""
    results: object   # gloo, {0, last stage's rank}: results, received by a thread of rank 0
    hidden: object    # nccl over the stage ranks, or None


def join_groups(store: dist.Store, rank: int, plan: Plan) -> Groups:
    """Every rank calls this, in the same order, once its stage (if any) is ready."""
    world = plan.num_stages + 1
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world, timeout=GROUP_TIMEOUT)
    results = dist.new_group([0, world - 1], backend="gloo", timeout=GROUP_TIMEOUT)
    hidden = (dist.new_group(list(range(1, world)), backend="nccl", timeout=GROUP_TIMEOUT)
              if plan.nccl else None)
    return Groups(results, hidden)
