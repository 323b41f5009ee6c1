"""What travels between processes and how: messages (window headers, results) and hidden
states, over torch.distributed point-to-point sends.

A message is pickled with its tensors as raw bytes (not torch's own tensor pickling, which
costs ~0.1 ms a tensor) and sent in one frame of FRAME bytes — a length, then the payload —
plus a second send only for what does not fit (long prompt chunks). Hidden states travel
as raw bytes on gloo, followed by every stage's compute seconds so far; on NCCL they stay on
the GPU and the seconds go on gloo. Sends are asynchronous: a Pending keeps each send's
buffers alive until it has completed.
"""

from __future__ import annotations

import io
import pickle
from collections import deque

import torch
import torch.distributed as dist

FRAME = 8192  # bytes of a message's first send: most headers and results fit
_LENGTH = 8


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


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:  # an empty tensor (a window that samples nothing has no sample rows)
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            host = obj.detach().cpu().contiguous()
            data = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
            return _tensor, (data, str(host.dtype).removeprefix("torch."), tuple(host.shape))
        return NotImplemented


def pack(obj) -> list[torch.Tensor]:
    """A message as its buffers to send: the first FRAME bytes, then any rest."""
    out = io.BytesIO()
    out.write(bytes(_LENGTH))
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    data = bytearray(out.getbuffer())
    size = len(data) - _LENGTH
    data[:_LENGTH] = size.to_bytes(_LENGTH, "little")
    if len(data) < FRAME:
        data.extend(bytes(FRAME - len(data)))
    whole = torch.frombuffer(data, dtype=torch.uint8)
    return [whole[:FRAME]] + ([whole[FRAME:]] if len(data) > FRAME else [])


def send_packed(buffers: list[torch.Tensor], dst: int, pending: Pending, group=None) -> None:
    for buffer in buffers:
        pending.add(dist.isend(buffer, dst, group=group), buffer)


def send_object(obj, dst: int, pending: Pending, group=None) -> None:
    send_packed(pack(obj), dst, pending, group)


def recv_object(src: int, group=None):
    frame = torch.empty(FRAME, dtype=torch.uint8)
    dist.recv(frame, src, group=group)
    data = frame.numpy().tobytes()
    size = int.from_bytes(data[:_LENGTH], "little")
    if _LENGTH + size > FRAME:
        rest = torch.empty(_LENGTH + size - FRAME, dtype=torch.uint8)
        dist.recv(rest, src, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data[_LENGTH:_LENGTH + size])


class HiddenLink:
    """Hidden states [T, hidden] and each stage's report (float64 [S, width]: its compute
    seconds, then what its expert cache did) between two neighbouring stages: on the GPU
    through `nccl_group`, or through host memory on gloo (CPU stages, or stages sharing a
    GPU)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 num_stages: int, nccl_group=None, width: int = 1):
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.num_stages, self.group, self.width = num_stages, nccl_group, width

    def send(self, x: torch.Tensor, seconds: torch.Tensor, dst: int, pending: Pending) -> None:
        if self.group is not None:
            x = x.contiguous()
            pending.add(dist.isend(x, dst, group=self.group), x)
            pending.add(dist.isend(seconds, dst), seconds)
            return
        hidden = x.detach().to("cpu").contiguous().view(-1).view(torch.uint8)  # NOTE: host sync
        data = torch.cat([hidden, seconds.reshape(-1).view(torch.uint8)])
        pending.add(dist.isend(data, dst), data)

    def recv(self, num_tokens: int, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [T, hidden] on the GPU or the host, reports float64 [S, width] on the
        host)."""
        shape = (num_tokens, self.hidden_size)
        if self.group is not None:
            x = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(x, src, group=self.group)
            seconds = torch.empty(self.num_stages, self.width, dtype=torch.float64)
            dist.recv(seconds, src)
            return x, seconds
        size = num_tokens * self.hidden_size * torch.finfo(self.dtype).bits // 8
        data = torch.empty(size + 8 * self.num_stages * self.width, dtype=torch.uint8)
        dist.recv(data, src)
        reports = data[size:].view(torch.float64).view(self.num_stages, self.width)
        return data[:size].view(self.dtype).view(shape), reports.clone()
