"""Checkpoints: GGUF files and Hugging Face folders behind one interface (checkpoint.py)."""

from strata.weights.checkpoint import Checkpoint, default_model_path, open_checkpoint

__all__ = ["Checkpoint", "default_model_path", "open_checkpoint"]
