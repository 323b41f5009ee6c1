"""The first minutes with the command line: `strata --help` says what Strata is and each
command's help shows every default; the API key comes from a flag, a file or the
environment; bad devices fail before any loading."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.cli import build_parser
from strata.errors import StrataError
from strata.server.config import API_KEY_ENV, ServerConfig, resolve_api_key


def command_help(name: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices)
    return " ".join(sub.choices[name].format_help().split())  # unwrapped


def test_top_level_help_says_what_strata_is():
    text = build_parser().format_help()
    assert "OpenAI-compatible inference server" in text
    assert "Engine flags are generated" not in text  # not the module's internal docstring
    for command in ("serve", "generate", "bench"):
        assert command in text
    assert "strata serve" in text and "--help" in text


@pytest.mark.parametrize("command,expected", [
    ("serve", ["--host HOST address to listen on (default: 127.0.0.1)",
               "(default: 8000)", "--parallel PARALLEL number of slots: requests decoded at "
               "once (default: 4)", "(default: cpu)", "(default: 3)", "(default: 30.0)"]),
    ("generate", ["sampling temperature, 0 = greedy (default: 0.0)",
                  "tokens to generate at most (default: 256)", "(default: 1)"]),
    ("bench", ["(default: 900)", "(default: bench-results.json)"]),
])
def test_command_help_shows_defaults(command, expected):
    text = command_help(command)
    for needle in expected:
        assert needle in text
    assert "(default: None)" not in text and "(default: ())" not in text
    assert text.count("default") < 2 * text.count("--")  # no flag says its default twice


def test_api_key_from_flag_file_or_environment(tmp_path):
    key_file = tmp_path / "key.txt"
    key_file.write_text("sk-from-file\n")
    assert resolve_api_key(ServerConfig(api_key="sk-flag"), {}).api_key == "sk-flag"
    assert resolve_api_key(ServerConfig(api_key_file=str(key_file)), {}).api_key == \
        "sk-from-file"
    assert resolve_api_key(ServerConfig(), {API_KEY_ENV: " sk-env "}).api_key == "sk-env"
    assert resolve_api_key(ServerConfig(), {}).api_key is None
    key_file.write_text("\n")
    with pytest.raises(StrataError, match="empty"):
        resolve_api_key(ServerConfig(api_key_file=str(key_file)), {})
    with pytest.raises(StrataError, match="cannot read"):
        resolve_api_key(ServerConfig(api_key_file=str(tmp_path / "none")), {})
    with pytest.raises(StrataError, match="not both"):
        resolve_api_key(ServerConfig(api_key="a", api_key_file=str(key_file)), {})


@pytest.mark.parametrize("flags,needle", [
    (["--devices", "cuda:0"], "cuda:0"),
    (["--layer-split", "10", "--devices", "cpu,cpu,cpu"], "3 devices for 2 stages"),
])
def test_generate_checks_devices_before_loading(flags, needle):
    out = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "Hi", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert needle in lines[-1] and not any("loading" in line for line in lines)


def test_engine_flags_help_formats_in_any_parser():
    """The benchmarks add the engine's flags to plain parsers: their help, plain text with
    "%" in it (`--expert-cache auto|N%|NGiB`), still formats."""
    import argparse

    from strata.cli import add_engine_flags

    parser = argparse.ArgumentParser(description="a benchmark")
    add_engine_flags(parser)
    text = " ".join(parser.format_help().split())
    assert "N%" in text and "a benchmark" in text
