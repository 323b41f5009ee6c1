"""Strata: an inference server for large language models split by layers across GPUs.

The package is organised by concept: `models/` (one file per architecture), `layers/`
(shared building blocks), `weights/` (GGUF and Hugging Face checkpoints), `kvcache/`
(block pool and cache tensors), `scheduler/` (slots, windows, all counting),
`engine/` (stages and the loop that runs windows through them), `sampling/`,
`tokenizer/` and `cli.py`.
"""

__version__ = "0.1.0"
