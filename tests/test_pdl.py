"""strata/layers/pdl.py: programmatic dependent launch is on only where the GPU has it and
`--pdl` leaves it on; before it waits for the previous kernel, a kernel that takes it
reads nothing but its weights and the window's metadata and writes nothing; compiled for
SM90 a kernel carries the griddepcontrol instructions, for SM86 none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import compile_kernel, offline_compiled

pytest.importorskip("triton")
from strata.layers import pdl  # noqa: E402

SOURCES = Path(pdl.__file__).parents[1]


def test_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert pdl.constants(torch.device("cpu")) == dict(PDL=False)
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    assert pdl.constants(torch.device("cuda:0")) == dict(PDL=True, launch_pdl=True)
    monkeypatch.setattr(pdl, "enabled", False)
    assert pdl.constants(torch.device("cuda:0")) == dict(PDL=False)


def test_one_wave_counts_programs_an_sm_holds(monkeypatch):
    """A kernel releases at its start only where all its programs start at once: ONE_WAVE
    an SM of the device, and only where PDL is on."""
    cuda = torch.device("cuda:0")
    assert not pdl.one_wave(1, torch.device("cpu"))
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    monkeypatch.setattr(pdl, "_sm_count", lambda device: 132)
    assert pdl.one_wave(132 * pdl.ONE_WAVE, cuda)
    assert not pdl.one_wave(132 * pdl.ONE_WAVE + 1, cuda)
    monkeypatch.setattr(pdl, "enabled", False)
    assert not pdl.one_wave(1, cuda)


def test_the_flag_takes_on_or_off():
    from strata.config import EngineConfig
    from strata.errors import StrataError

    assert EngineConfig().pdl == "on" and EngineConfig(pdl="off").pdl == "off"
    with pytest.raises(StrataError, match="--pdl sometimes is not one of on, off"):
        EngineConfig(pdl="sometimes")


def pdl_kernels() -> dict[str, ast.FunctionDef]:
    """Every function of strata/ with a PDL parameter, by module and name."""
    found = {}
    for path in SOURCES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    a.arg == "PDL" for a in node.args.args) and path.name != "pdl.py":
                found[f"{path.relative_to(SOURCES)}:{node.name}"] = node
    return found


# What a kernel reads before its wait (pdl.py's rule: only what no kernel writes: its
# weights, the window's metadata), by kernel: its pointer arguments read there. Every
# other kernel waits first.
READ_BEFORE_WAIT = {
    "attention/triton_kernel.py:_paged_attention": {
        "tile_entry_ptr", "tile_start_ptr", "tile_count_ptr", "block_tables_ptr",
        "positions_ptr"},
    "layers/rotary_triton.py:_norm_rotate": {"pos_ptr", "slot_ptr", "cos_ptr", "sin_ptr"},
    "layers/gemv_triton.py:_gemv": {"w_ptr"},
    "layers/gemv_triton.py:_gemm": {"w_ptr"},
    "layers/norm_triton.py:_rms_norm": {"w_ptr"},
    "layers/route_triton.py:_norm_logits": {"norm_ptr", "router_ptr"},
    "quant/triton_quant.py:_gemv_rows": {"blocks_ptr"},
    "layers/l2_prefetch.py:_prefetch": {"w_ptr"},
}
WRITES = ("tl.store", "tl.atomic_add", "tl.atomic_xchg", "tl.atomic_cas", "tl.atomic_max",
          "tl.atomic_min", "tl.atomic_or", "tl.atomic_and")


def before_wait(node: ast.FunctionDef) -> list[ast.stmt]:
    """The statements a kernel runs before `pdl.wait()`: those before the `if PDL:` that
    holds it, and those before it there."""
    ahead = []
    for statement in node.body:
        if isinstance(statement, ast.If) and ast.unparse(statement.test) == "PDL" and any(
                ast.unparse(s) == "pdl.wait()" for s in statement.body):
            for inner in statement.body:
                if ast.unparse(inner) == "pdl.wait()":
                    return ahead
                ahead.append(inner)
        ahead.append(statement)
    raise AssertionError(f"{node.name} never waits")


def test_before_its_wait_a_kernel_reads_only_weights():
    """pdl.py's rule: nothing before `wait` writes, or reads what a kernel writes: a
    kernel waits first, or reads there only the pointers READ_BEFORE_WAIT names. Each
    waits once and releases."""
    kernels = pdl_kernels()
    assert len(kernels) >= 15, sorted(kernels)
    assert set(READ_BEFORE_WAIT) <= set(kernels), set(READ_BEFORE_WAIT) - set(kernels)
    for name, node in kernels.items():
        ahead = [s for s in before_wait(node) if not (isinstance(s, ast.Expr)
                                                       and isinstance(s.value, ast.Constant))]
        code = "\n".join(map(ast.unparse, ahead))
        assert not any(write + "(" in code for write in WRITES), (name, code)
        pointers = {n.id for s in ahead for n in ast.walk(s)
                    if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
        assert pointers <= READ_BEFORE_WAIT.get(name, set()), (name, pointers)
        calls = [ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Call)]
        assert calls.count("pdl.wait()") == 1 and "pdl.release()" in calls, name


def _compiled_ptx(arch: int) -> str:
    from strata.layers import moe_triton

    def types(name: str) -> str:
        return "*fp32" if name == "out_ptr" else "*bf16" if name == "y_ptr" else "i32"

    kernel = compile_kernel(moe_triton._combine, arch, dict(TOP_K=8, BLOCK_H=512), types,
                            dict(num_warps=4, num_stages=2))
    return kernel.asm["ptx"]


def _griddepcontrol(arch: int) -> int:
    ptx = _compiled_ptx(arch)
    return int("griddepcontrol.wait" in ptx) + int("griddepcontrol.launch_dependents" in ptx)


def test_sm90_kernels_carry_griddepcontrol_and_sm86_ones_do_not(tmp_path):
    code = ("from test_pdl import _griddepcontrol\n"
            "print(_griddepcontrol(arch))")
    assert offline_compiled(code, tmp_path, archs=(90, 86)) == [2, 0]
