"""What travels between processes and how: pickled messages (window headers, results)
and hidden states, over torch.distributed point-to-point sends.

A message is two sends: its length, then its bytes. Hidden states travel as raw bytes
so that any dtype crosses gloo; on NCCL they stay on the GPU. Sends are asynchronous:
a Pending keeps each send's buffers alive until the send has completed.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist


class Pending:
    """Asynchronous sends in flight, waited for oldest first once there are many."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self._works: deque = deque()

    def add(self, work, *buffers: torch.Tensor) -> None:
        self._works.append((work, buffers))
        while len(self._works) > self.limit:
            self._works.popleft()[0].wait()

    def wait_all(self) -> None:
        while self._works:
            self._works.popleft()[0].wait()


def send_object(obj, dst: int, pending: Pending, group=None) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.long)
    pending.add(dist.isend(length, dst, group=group), length)
    pending.add(dist.isend(data, dst, group=group), data)


def recv_object(src: int, group=None):
    length = torch.zeros(1, dtype=torch.long)
    dist.recv(length, src, group=group)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return pickle.loads(data.numpy().tobytes())


class HiddenLink:
    """Hidden states [T, hidden] between two neighbouring stages: on the GPU through
    `nccl_group`, or through host memory on gloo (CPU stages, or stages sharing a GPU)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 nccl_group=None):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.group = nccl_group

    def send(self, x: torch.Tensor, dst: int, pending: Pending) -> None:
        if self.group is not None:
            x = x.contiguous()
            pending.add(dist.isend(x, dst, group=self.group), x)
            return
        data = x.detach().to("cpu").contiguous().view(-1).view(torch.uint8)  # NOTE: host sync
        pending.add(dist.isend(data, dst), data)

    def recv(self, num_tokens: int, src: int) -> torch.Tensor:
        shape = (num_tokens, self.hidden_size)
        if self.group is not None:
            x = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(x, src, group=self.group)
            return x
        size = num_tokens * self.hidden_size * torch.finfo(self.dtype).bits // 8
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, src)
        return data.view(self.dtype).view(shape)
