"""ModelRunner: builds the stages of a checkpoint and sends windows through them.

In this process the stages run one after another, each on its own device; hidden
states move between devices as the window goes. The last stage's logits are sampled
here, and the sampled token ids are the one host read of a window.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from strata.config import EngineConfig
from strata.engine.stage import Stage
from strata.errors import StrataError
from strata.models.registry import get_architecture
from strata.sampling.sampler import Sampler
from strata.scheduler.window import Window
from strata.spec.mtp import MTPDrafter
from strata.spec.verifier import Verifier, VerifyEntry


def check_device(device: torch.device) -> None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StrataError(f"device {device} requested but this PyTorch has no usable CUDA "
                              "GPU; use --devices cpu or install a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise StrataError(f"device {device} does not exist: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise StrataError(f"device type '{device.type}' is not supported (use cpu or cuda:N)")


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint, num_blocks: int, max_context: int,
                 mtp: bool = False):
        model_config = checkpoint.config
        arch = get_architecture(model_config)
        ranges = config.stage_ranges(model_config.num_layers)
        for i in range(len(ranges)):
            check_device(config.stage_device(i))
        self.stages = [
            Stage(i, arch, layers, len(ranges), config.stage_device(i), config.torch_dtype(),
                  config.kv_dtype(), num_blocks, config.block_size, mtp=mtp)
            for i, layers in enumerate(ranges)]
        total = sum(sum(1 for _ in s.module.parameters()) for s in self.stages)
        with tqdm(total=total, desc="loading", unit="tensor", file=sys.stderr,
                  disable=not sys.stderr.isatty(), leave=False) as progress:
            for stage in self.stages:
                stage.load(checkpoint, progress)
        self.sampler = Sampler()
        self.verifier = Verifier(self.sampler)
        self.simulate_acceptance = config.simulate_acceptance
        last = self.stages[-1]
        self.mtp = (MTPDrafter(last.module.mtp, last.mtp_cache, config.spec, config.spec_min_p,
                               max_context) if last.mtp_cache is not None else None)

    def forward(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [S, vocab] of the rows the window asks for, final-norm hidden [T, h])."""
        x = window.token_ids
        for stage in self.stages[:-1]:
            x = stage.forward(x, window.meta(stage.device))
        return self.stages[-1].forward(x, window.meta(self.stages[-1].device))

    def execute(self, window: Window) -> tuple[list[list[int]], list | None]:
        """Run the window and verify it: per sampling entry, its accepted drafts plus one
        token (one sampled token where it carries no drafts); then, with an MTP layer,
        each sampling entry's drafts for its next window."""
        logits, hidden = self.forward(window)
        entries = [VerifyEntry(r.params, r.request_id, d.tokens if d is not None else [],
                               position=r.num_tokens)
                   for r, d, s in zip(window.requests, window.drafts, window.samples) if s]
        if self.simulate_acceptance is not None:
            results = self.verifier.simulate(logits, entries, self.simulate_acceptance)
        else:
            results = self.verifier.verify(logits, entries) if entries else []  # NOTE: host sync
        if self.mtp is None:
            return results, None
        following = [None if s else r.token_ids[p + n] if p + n < r.num_tokens else None
                     for r, s, p, n in zip(window.requests, window.samples,
                                           window.entry_starts(), window.query_lens)]
        return results, self.mtp.draft(window, results, hidden, following)
