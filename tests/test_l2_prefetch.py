"""strata/layers/l2_prefetch.py: a weight asked into L2 ahead of its product. It asks only
on a GPU with the bulk prefetch (compute capability 9.0) and while `--l2-prefetch` leaves it
on; the asks cover every byte of the weight once; compiled for SM90 the kernel carries the
bulk prefetch and the griddepcontrol pair; a layer asks for o_proj's weight only where its
window would read it on the GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import compile_kernel, offline_compiled

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from strata.layers import l2_prefetch  # noqa: E402
from strata.layers.linear import PREFETCH_TOKENS, LinearFactory  # noqa: E402


@triton.jit
def _record_plan(starts_ptr, sizes_ptr, num_bytes, CHUNK: tl.constexpr,
                 THREADS: tl.constexpr):
    """Each thread's ask of `_prefetch`'s program p, recorded (size 0: no ask)."""
    start, asks, size = l2_prefetch.plan(tl.program_id(0), num_bytes, CHUNK, THREADS)
    at = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    tl.store(starts_ptr + at, start)
    tl.store(sizes_ptr + at, tl.where(asks, size, 0))


@triton.jit
def _record_share(firsts_ptr, sizes_ptr, values, ASKS: tl.constexpr,
                  ASK_VALUES: tl.constexpr):
    """Column tile p's asks of the MoE gate and up kernel, recorded (size 0: no ask)."""
    first, asks, size = l2_prefetch.share(tl.program_id(0), tl.num_programs(0), values, ASKS,
                                          ASK_VALUES)
    at = tl.program_id(0) * ASKS + tl.arange(0, ASKS)
    tl.store(firsts_ptr + at, tl.where(asks, first, 0))
    tl.store(sizes_ptr + at, tl.where(asks, size, 0))


def test_nothing_is_asked_on_the_cpu_or_when_off(monkeypatch):
    launched = []
    monkeypatch.setattr(l2_prefetch, "_prefetch", type("K", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: launched.append(grid)})())
    assert not l2_prefetch.enabled  # off by default (--l2-prefetch off)
    monkeypatch.setattr(l2_prefetch, "enabled", True)
    l2_prefetch.prefetch(torch.ones(64, 64))  # a CPU tensor
    assert launched == []
    monkeypatch.setattr(l2_prefetch, "supported", lambda device: True)
    fake = torch.ones(64, 64)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    l2_prefetch.prefetch(fake)
    assert launched == [(1,)]
    l2_prefetch.prefetch(torch.ones(3, dtype=torch.uint8))  # no whole 16-byte unit
    l2_prefetch.prefetch(torch.ones(64)[1:])  # not 16-byte aligned
    assert launched == [(1,)]
    monkeypatch.setattr(l2_prefetch, "enabled", False)
    l2_prefetch.prefetch(fake)
    assert launched == [(1,)]


@pytest.mark.parametrize("num_bytes", [16, l2_prefetch.CHUNK, 5 * l2_prefetch.CHUNK + 48,
                                       l2_prefetch.CHUNK * l2_prefetch.THREADS + 16,
                                       2048 * 4096 * 2])
def test_the_asks_cover_every_byte_once(num_bytes):
    """The kernel's plan (`plan`, run in triton's interpreter over the launch's programs):
    thread i of program p asks for bytes from (p THREADS + i) CHUNK, at most CHUNK of them,
    while that start is in the weight."""
    programs, threads = l2_prefetch.chunks(num_bytes), l2_prefetch.THREADS
    starts, sizes = (torch.zeros(programs * threads, dtype=torch.int64) for _ in range(2))
    _record_plan[(programs,)](starts, sizes, num_bytes, CHUNK=l2_prefetch.CHUNK,
                              THREADS=threads)
    covered = torch.zeros(num_bytes, dtype=torch.int32)
    for start, size in zip(starts.tolist(), sizes.tolist()):
        if size:
            assert size % 16 == 0 and start % 16 == 0
            covered[start:start + size] += 1
    assert bool((covered == 1).all())
    assert l2_prefetch.chunks(num_bytes) * l2_prefetch.THREADS * l2_prefetch.CHUNK < (
        num_bytes + l2_prefetch.THREADS * l2_prefetch.CHUNK)


def test_a_projection_asks_only_for_windows_the_gpu_reads(monkeypatch):
    asked = []
    monkeypatch.setattr(l2_prefetch, "prefetch", asked.append)
    proj = LinearFactory()(64, 32)
    proj.prefetch(torch.ones(1, 64))  # the CPU: nothing
    assert asked == []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    proj.prefetch(torch.ones(PREFETCH_TOKENS + 1, 64))  # a prompt chunk: nothing
    assert asked == []
    proj.prefetch(torch.ones(PREFETCH_TOKENS, 64))
    assert asked == [proj.weight]


@pytest.mark.parametrize("hidden, inter, block_n", [(2048, 768, 32), (64, 32, 32),
                                                   (4096, 1536, 32), (2048, 512, 64)])
def test_the_gate_and_up_kernel_asks_for_each_down_weight_once(hidden, inter, block_n,
                                                              monkeypatch):
    """moe_triton.down_asks: its column tiles' asks (l2_prefetch.share, run in triton's
    interpreter as `_gate_up` runs it: tile, tile + tiles, ... of ASK_VALUES values) cover the expert's H x I down weights once; none
    on the CPU, when off, for a window of more than CHOOSE_TOKENS tokens or an expert
    cache's rows."""
    from strata.layers import moe_triton
    down = torch.zeros(3, hidden, inter, dtype=torch.bfloat16)
    tiles = triton.cdiv(inter, block_n)
    assert moe_triton.down_asks(down, 1, inter, block_n, False)["ASKS"] == 0  # the CPU
    monkeypatch.setattr(l2_prefetch, "supported", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert moe_triton.down_asks(down, 1, inter, block_n, False)["ASKS"] == 0  # off
    monkeypatch.setattr(l2_prefetch, "enabled", True)
    assert moe_triton.down_asks(down, 3, inter, block_n, False)["ASKS"] == 0
    assert moe_triton.down_asks(down, 1, inter, block_n, True)["ASKS"] == 0
    assert moe_triton.down_asks(down[:, :, 1:], 1, inter, block_n, False)["ASKS"] == 0
    plan = moe_triton.down_asks(down, 2, inter, block_n, False)
    assert plan["stride_de"] == hidden * inter and plan["ASKS"] > 0
    values, asks = hidden * inter, plan["ASKS"]
    firsts, sizes = (torch.zeros(tiles * asks, dtype=torch.int64) for _ in range(2))
    _record_share[(tiles,)](firsts, sizes, values, ASKS=asks, ASK_VALUES=plan["ASK_VALUES"])
    covered = torch.zeros(values, dtype=torch.int32)
    for first, size in zip(firsts.tolist(), sizes.tolist()):  # sizes in bytes, 16-bit values
        covered[first:first + size // 2] += 1
    assert bool((covered == 1).all())


def _compiled_ptx() -> str:
    kernel = compile_kernel(l2_prefetch._prefetch, 90, dict(
        CHUNK=l2_prefetch.CHUNK, THREADS=l2_prefetch.THREADS),
        lambda name: "*u8" if name.endswith("_ptr") else "i64", dict(num_warps=4))
    return kernel.asm["ptx"]


def _instructions() -> int:
    ptx = _compiled_ptx()
    return sum(int(i in ptx) for i in ("cp.async.bulk.prefetch.L2.global",
                                       "griddepcontrol.wait",
                                       "griddepcontrol.launch_dependents"))


def test_compiled_for_sm90_it_carries_the_bulk_prefetch(tmp_path):
    code = "from test_l2_prefetch import _instructions\nprint(_instructions())"
    assert offline_compiled(code, tmp_path, archs=(90,)) == [3]
