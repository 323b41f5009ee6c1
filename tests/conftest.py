"""Shared fixtures: the embedded default GGUF (opened once per session, and transformers'
tokenizer of it), a tiny random model that serves with that tokenizer, and tiny random
checkpoints that the tests build from a config with transformers' `save_pretrained` (no
hub, no downloads)."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# No GPU: the triton backend's kernel runs in triton's interpreter (chosen at its import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.08)


def default_gguf() -> Path:
    from strata.weights import default_model_path
    return default_model_path()


def build_tiny(kind: str, folder: Path, **overrides):
    """Save a tiny random transformers model of `kind` to `folder`; return the model."""
    import transformers

    torch.manual_seed(1234)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**TINY, "tie_word_embeddings": True, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{**TINY, "head_dim": 24, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{
            **TINY, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
            "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [1], **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(kind)
    model.eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return default_gguf()


@pytest.fixture(scope="session")
def default_checkpoint(gguf_path):
    """The default GGUF opened once (its metadata takes seconds to parse), each tensor
    dequantized once: give it to `Engine(config, checkpoint)` or `LLM(config, checkpoint)`
    with `model=str(gguf_path)` in the config. Every engine still builds and loads its own
    stages from it; only the file's decoding is shared."""
    from strata.weights.checkpoint import open_checkpoint

    from strata.weights.tensor import StoredTensor

    checkpoint = open_checkpoint(gguf_path)
    read = checkpoint.read

    @functools.cache
    def dequantized_once(name: str) -> StoredTensor:
        # NOTE: the same values the loader would get (dequantized to float32, then cast);
        # stages copy each tensor into their own parameters and never change it in place.
        return StoredTensor.of(read(name).dense(torch.float32))

    checkpoint.read = dequantized_once
    return checkpoint


@pytest.fixture(scope="session")
def gguf_tokenizer_reference(gguf_path):
    """transformers' tokenizer of the default GGUF (the reference for Strata's)."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                      gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory, gguf_tokenizer_reference) -> Path:
    """A folder with a tiny random llama and the default model's tokenizer and chat
    template: for tests of servers and processes, not of the model; it loads in a blink.
    The end-of-text tokens' embeddings (tied to the output layer) are zero, so their
    logits are 0 and greedy answers run to max_tokens."""
    from strata.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny_served")
    gguf_tokenizer_reference.save_pretrained(folder)
    tokenizer = Tokenizer.from_hf_folder(folder)
    model = build_tiny("llama", folder, vocab_size=tokenizer.vocab_size,
                       max_position_embeddings=4096)
    with torch.no_grad():
        for token in {*tokenizer.eos_token_ids, model.config.eos_token_id}:
            model.model.embed_tokens.weight[token] = 0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{kind: (folder, transformers model)} for llama, qwen3 and qwen3_moe."""
    out = {}
    for kind in ("llama", "qwen3", "qwen3_moe"):
        folder = tmp_path_factory.mktemp(kind)
        out[kind] = (folder, build_tiny(kind, folder))
    return out


def prompts(n: int, vocab: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    """n random prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


class Oracle:
    """A proposer that knows the greedy continuation of each prompt it is given and drafts
    it with some tokens wrong (seeded): windows carry drafts that are accepted, cut short
    and rejected outright, so every way a window's drafts roll back is exercised. It
    drafts nothing for other prompts."""
    name, on_last_stage = "oracle", False

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], seed: int = 0):
        self.expected = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.rng = random.Random(seed)
        self.requests: dict[str, tuple[list[int], list[int]]] = {}

    def start(self, rid, prompt):
        if tuple(prompt) in self.expected:
            self.requests[rid] = (self.expected[tuple(prompt)], [])

    def extend(self, rid, tokens, stage_drafts=None):
        if rid in self.requests:
            self.requests[rid][1].extend(tokens)

    def finish(self, rid):
        self.requests.pop(rid, None)

    def propose(self, rid, max_tokens):
        from strata.drafting.draft import Draft

        expected, done = self.requests.get(rid, ([], []))
        ahead = expected[len(done):len(done) + min(max_tokens, 4)]
        if not ahead:
            return None
        tokens = [t if self.rng.random() > 0.25 else (t + 1) % 320 for t in ahead]
        return Draft(tokens, [0.9 ** (j + 1) for j in range(len(tokens))], self.name)


SM86_SHARED = 99 * 1024  # the most shared memory a block may use on an RTX 3090
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_kernel(kernel, arch: int, constants: dict, types, options: dict):
    """`kernel` (a triton.jit function) as triton compiles it for an NVIDIA GPU of compute
    capability `arch`, without one: `constants` its constexprs (a kernel's PDL, unless
    given, on from SM90, as launched), `types(name)` the triton type of each other
    argument, `options` the launch's (num_warps, num_stages). Only in a process where the
    interpreter is off (offline_compiled)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel.fn  # the Python function under jit or interpreter
    if "PDL" in inspect.signature(fn).parameters and "PDL" not in constants:
        # strata/layers/pdl.py: griddepcontrol where the GPU has it (SM90), as launched
        constants = {**constants, "PDL": arch >= 90}
    signature = {name: "constexpr" if name in constants else types(name)
                 for name in inspect.signature(fn).parameters}
    return triton.compile(ASTSource(fn=JITFunction(fn), signature=signature,
                                    constexprs=constants),
                          target=GPUTarget("cuda", arch, 32), options=options)


def offline_compiled(code: str, cache: Path, archs: tuple[int, ...] = (86, 90)) -> list[int]:
    """Run `code` once per GPU architecture in `archs` (the name `arch` holds it), each in a
    fresh process where triton compiles for that GPU without one (the interpreter is off
    there; it cannot run where the interpreter was chosen), all at once; return the
    integers they print (the compiled kernels' shared memory), in the order of `archs`.
    Skips where this triton cannot compile offline."""
    pytest.importorskip("triton.backends.nvidia")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton cannot compile offline: {e}")
    runs = [subprocess.Popen(
        [sys.executable, "-c", f"arch = {arch}\n{code}"], cwd=Path(__file__).parent,
        env={**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache / str(arch))},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in archs]
    done = [(run, *run.communicate()) for run in runs]  # all finish, even when one fails
    printed = []
    for run, out, err in done:
        assert run.returncode == 0, err[-4000:]
        printed += [int(n) for n in out.split()]
    return printed
