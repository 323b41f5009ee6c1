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
    def __init__(self, config: EngineConfig, checkpoint, num_blocks: int):
        model_config = checkpoint.config
        arch = get_architecture(model_config)
        ranges = config.stage_ranges(model_config.num_layers)
        for i in range(len(ranges)):
            check_device(config.stage_device(i))
        self.stages = [
            Stage(i, arch, layers, len(ranges), config.stage_device(i), config.torch_dtype(),
                  config.kv_dtype(), num_blocks, config.block_size)
            for i, layers in enumerate(ranges)]
        total = sum(sum(1 for _ in s.module.parameters()) for s in self.stages)
        with tqdm(total=total, desc="loading", unit="tensor", file=sys.stderr,
                  disable=not sys.stderr.isatty(), leave=False) as progress:
            for stage in self.stages:
                stage.load(checkpoint, progress)
        self.sampler = Sampler()

    def forward(self, window: Window) -> torch.Tensor:
        """Logits [S, vocab] for the window's sampling entries."""
        x = window.token_ids
        for stage in self.stages:
            x = stage.forward(x, window.meta(stage.device))
        return x

    def execute(self, window: Window) -> list[int]:
        """Run the window and sample one token per sampling entry."""
        logits = self.forward(window)
        requests = window.sampled_requests
        if not requests:
            return []
        tokens = self.sampler.sample(logits, [r.params for r in requests],
                                     [r.request_id for r in requests])
        return tokens.tolist()  # NOTE: the window's one host sync
