"""`strata generate`: it streams an answer, and every kind of bad input ends with one clear
line on stderr and exit status 2, never a traceback. A few runs are real processes
(`python -m strata.cli`: the exit status and streamed stdout of a process); the rest call
`strata.cli.main` in this process, which is what the process runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import default_gguf
from strata.cli import main

PROMPT = "What is the capital of France? Answer in one short sentence."


def run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python -m strata.cli generate ...` in a new process."""
    return subprocess.run([sys.executable, "-m", "strata.cli", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


def generate(capsys, *args: str) -> subprocess.CompletedProcess:
    """`strata generate ...` in this process: main()'s exit status (argparse's, for flags
    it rejects) and what it printed. An exception main() lets out fails the test."""
    try:
        status = main(["generate", *args])
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["strata", "generate", *args], status, out.out, out.err)


def assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or lines[-1].startswith("strata generate: error:"), result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def test_generate_streams_the_answer():
    result = run(PROMPT, "--max-tokens", "24", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "generated" in result.stderr


def test_generate_raw_completion_is_deterministic(capsys, tiny_served_model):
    flags = ["def fibonacci(n):", "--raw", "--max-tokens", "16", "--model", str(tiny_served_model)]
    first = generate(capsys, *flags)
    second = generate(capsys, *flags, "--layer-split", "2")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_missing_model_file():  # a real process: its exit status and its stderr
    assert_clean_error(run(PROMPT, "--model", "/no/such/model.gguf"), "/no/such/model.gguf",
                       "--model")


def test_truncated_gguf(capsys, tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(default_gguf().read_bytes()[:3_000_000])
    assert_clean_error(generate(capsys, PROMPT, "--model", str(truncated)), "cut.gguf",
                       "truncated")


def test_truncated_safetensors(capsys, tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    for f in folder.iterdir():
        data = f.read_bytes()
        (tmp_path / f.name).write_bytes(data[:len(data) // 2] if f.suffix == ".safetensors" else data)
    assert_clean_error(generate(capsys, PROMPT, "--model", str(tmp_path)), "truncated")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_clean_error(generate(capsys, PROMPT, "--model", str(tmp_path)), "GPT2LMHeadModel",
                       "llama, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next")


def test_prompt_longer_than_context(capsys, tiny_served_model):
    result = generate(capsys, PROMPT, "--max-context", "12", "--model", str(tiny_served_model))
    assert_clean_error(result, "--max-context is 12")
    assert "the prompt is " in result.stderr


@pytest.mark.parametrize("split", ["10,5", "0", "30", "x,y"])
def test_invalid_layer_split(capsys, split):
    assert_clean_error(generate(capsys, PROMPT, "--layer-split", split), "--layer-split")


def test_unknown_device(capsys):
    assert_clean_error(generate(capsys, PROMPT, "--devices", "tpu:0"), "tpu")


@pytest.mark.parametrize("flags,needle", [
    (["--batch-groups", "0"], "--batch-groups 0"),
    (["--batch-groups", "5", "--parallel", "4"], "--parallel (4)"),
    (["--batch-groups", "many"], "neither auto nor a whole number"),
    (["--stage-threads", "0"], "--stage-threads"),
    (["--stage-timeout", "0"], "--stage-timeout"),
    (["--layer-split", "15", "--devices", "cpu,cpu,cpu"], "3 devices for 2 stages"),
])
def test_invalid_pipeline_flags(capsys, flags, needle):
    assert_clean_error(generate(capsys, PROMPT, *flags), needle)


def test_batch_groups_resolve():
    from strata.config import EngineConfig
    assert EngineConfig(layer_split=(10, 20), devices=("cpu",) * 3, parallel=4).num_groups() == 3
    assert EngineConfig(layer_split=(10, 20), devices=("cpu",) * 3, parallel=2).num_groups() == 2
    assert EngineConfig(layer_split=(10, 20), parallel=4).num_groups() == 1  # one process
    assert EngineConfig(layer_split=(10,), devices=("cpu", "cpu"), parallel=4,
                        batch_groups=4).num_groups() == 4
    assert not EngineConfig(devices=("cpu",)).stage_processes


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "calibrate"])
def test_every_flag_has_readable_help(capsys, command):
    """argparse formats help with %: a flag whose help says "25%" must still print."""
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    if command != "bench":  # its arms carry the engine flags
        assert "--experts-in-ram" in out and "N% of the stage's routed experts" in out
