"""Text side of a model: tokenizer (GGUF or Hugging Face folder), chat templates, streaming text."""

from strata.tokenizer.chat import render_chat
from strata.tokenizer.detokenize import IncrementalDetokenizer, StopStrings
from strata.tokenizer.gguf_vocab import read_gguf_fields
from strata.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStrings", "Tokenizer", "read_gguf_fields", "render_chat"]
