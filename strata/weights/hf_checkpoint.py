"""Hugging Face checkpoint folders: `config.json`, one or many `*.safetensors`,
`tokenizer.json` and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

from strata.errors import StrataError
from strata.models.config import ModelConfig
from strata.models.registry import resolve_hf_architecture
from strata.weights.tensor import StoredTensor


class HFCheckpoint:
    format = "hf"

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        config_file = path / "config.json"
        if not config_file.is_file():
            raise StrataError(f"{path} has no config.json; pass a Hugging Face checkpoint folder "
                              "or a GGUF file")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise StrataError(f"{config_file} is not valid JSON ({e}); restore the file") from None
        self.raw_config = raw
        self.config = ModelConfig.from_hf(raw, resolve_hf_architecture(raw))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise StrataError(f"{path} has no *.safetensors files; Strata reads safetensors "
                              "weights only (convert .bin files with transformers first)")
        self._files = {}
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                keys = list(handle.keys())
            except Exception as e:
                raise StrataError(f"{f} is not a readable safetensors file ({e}); it may be "
                                  "truncated: download it again") from None
            self._files[f] = handle
            for key in keys:
                self._where[key] = f

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> StoredTensor:
        if name not in self._where:
            raise StrataError(f"{self.path} has no tensor '{name}'; the checkpoint is incomplete "
                              "or does not match its config.json")
        try:
            return StoredTensor.of(self._files[self._where[name]].get_tensor(name))
        except Exception as e:
            raise StrataError(f"cannot read '{name}' from {self._where[name]} ({e}); the file may "
                              "be truncated: download it again") from None

    def load_tokenizer(self):
        from strata.tokenizer import Tokenizer
        return Tokenizer.from_hf_folder(self.path)
