"""Building a `tokenizers.Tokenizer` from the tokenizer metadata of a GGUF file.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, scores and token types
as metadata keys. This module owns turning those keys into a Hugging Face `tokenizers.Tokenizer`
that tokenizes the way llama.cpp does, for the two vocabulary kinds Strata supports:

- `gpt2`: byte-level BPE. The pre-tokenizer regex is chosen by `tokenizer.ggml.pre`.
- `llama`: SentencePiece-style BPE driven by token scores, with `<0xNN>` byte fallback and `▁`
  standing for a space.

It also reads GGUF metadata into plain Python values (`read_gguf_fields`). It does not know about
BOS/EOS policy, chat templates or streaming; `tokenizer.py` owns those.
"""

from __future__ import annotations

import os

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from strata.errors import StrataError

# llama.cpp's token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = "gpt2 (BPE), llama (SentencePiece)"


def read_gguf_fields(source) -> dict:
    """All metadata key/values of a GGUF file as plain Python values (str, int, float, bool, list).
    `source` is a path or an open `gguf.GGUFReader` (parsing a file is slow: reuse one)."""
    if isinstance(source, gguf.GGUFReader):
        reader = source
    else:
        try:
            reader = gguf.GGUFReader(os.fspath(source), "r")
        except (OSError, ValueError) as exc:
            raise StrataError(f"cannot read GGUF file {os.fspath(source)!r}: {exc}; "
                              "check the path is a .gguf model") from None
    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    fields = {}
    for name, field in reader.fields.items():
        if not field.types:
            continue
        main = field.types[0]
        if main == string:
            fields[name] = field.parts[field.data[0]].tobytes().decode("utf-8", errors="replace")
        elif main == array:
            sub = field.types[-1]
            if len(field.types) != 2:
                continue  # NOTE: nested arrays are not used by any tokenizer key; leave them out.
            if sub == string:
                fields[name] = [field.parts[i].tobytes().decode("utf-8", errors="replace") for i in field.data]
            else:
                fields[name] = [v for i in field.data for v in field.parts[i].tolist()]
        else:
            value = field.parts[field.data[0]].tolist()[0]
            fields[name] = bool(value) if main == gguf.GGUFValueType.BOOL else value
    return fields


# Pre-tokenizer splits from llama.cpp's `llm_tokenizer_bpe`, in the spelling of the original
# tokenizer.json files (the `tokenizers` regex engine supports `(?i:...)`).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre():
    # llama.cpp: regex "\p{N}" (each digit alone) then the GPT-2 regex.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_pre(pattern: str):
    def build():
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# tokenizer.ggml.pre -> (pre-tokenizer builder, ignore_merges). Names grouped as llama.cpp groups them.
_BPE_PRE = {
    "gpt2": (_gpt2_pre, False),
    # NOTE: llama.cpp's "default" also splits punctuation runs and long numbers; we use the plain
    # GPT-2 split, as for a file without tokenizer.ggml.pre.
    "default": (_gpt2_pre, False),
    "mpt": (_gpt2_pre, False),
    "olmo": (_gpt2_pre, False),
    "smollm": (_digits_then_gpt2_pre, False),
    "starcoder": (_digits_then_gpt2_pre, False),
    "refact": (_digits_then_gpt2_pre, False),
    "command-r": (_digits_then_gpt2_pre, False),
    "codeshell": (_digits_then_gpt2_pre, False),
    "qwen2": (_split_pre(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_split_pre(_QWEN2_SPLIT), False),
    "stablelm2": (_split_pre(_QWEN2_SPLIT), False),
    "llama-bpe": (_split_pre(_LLAMA3_SPLIT), True),
    "llama3": (_split_pre(_LLAMA3_SPLIT), True),
    "llama-v3": (_split_pre(_LLAMA3_SPLIT), True),
    "dbrx": (_split_pre(_LLAMA3_SPLIT), False),
    "smaug-bpe": (_split_pre(_LLAMA3_SPLIT), False),
}

# Pre-tokenizers whose models llama.cpp starts with BOS when the file does not say.
LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


def build_gguf_backend(fields: dict) -> Backend:
    """The `tokenizers.Tokenizer` llama.cpp would use for these GGUF fields (no BOS/EOS post-processing)."""
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise StrataError(
            "the GGUF has no tokenizer (tokenizer.ggml.model/tokens missing); use a GGUF converted with its tokenizer"
        )
    if model == "gpt2":
        backend = _byte_level_bpe(fields)
    elif model == "llama":
        backend = _sentencepiece_bpe(fields)
    else:
        raise StrataError(f"tokenizer model {model!r} in the GGUF is not supported (supported: {SUPPORTED_MODELS})")
    _add_special_tokens(backend, tokens, fields.get("tokenizer.ggml.token_type"))
    return backend


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token spelled twice keeps its first id, as llama.cpp's text_to_token does."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _byte_level_bpe(fields: dict) -> Backend:
    pre = fields.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _BPE_PRE:
        supported = ", ".join(sorted(_BPE_PRE))
        raise StrataError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported}); use another model")
    build_pre, ignore_merges = _BPE_PRE[pre]
    vocab = _first_ids(fields["tokenizer.ggml.tokens"])
    merges = []
    for line in fields.get("tokenizer.ggml.merges", []):
        cut = line.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise StrataError(f"GGUF merge {line!r} has no space; the merges are corrupt, re-convert the model")
        merges.append((line[:cut], line[cut + 1 :]))
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
    except Exception as exc:  # tokenizers raises a plain Exception for merges naming unknown tokens
        raise StrataError(f"GGUF BPE vocabulary is inconsistent ({exc}); re-convert the model") from exc
    backend = Backend(bpe)
    backend.pre_tokenizer = build_pre()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(fields: dict) -> Backend:
    tokens = fields["tokenizer.ggml.tokens"]
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise StrataError("the GGUF 'llama' tokenizer lacks tokenizer.ggml.scores for its tokens; re-convert the model")
    vocab = _first_ids(tokens)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = _score_merges(vocab, scores)
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Backend(bpe)
    # NOTE: llama.cpp prepends a space to every run of text that starts the input or follows a
    # special token, even when the text already starts with a space (" a" -> "▁▁a", as
    # SentencePiece does). A normalizer runs once per such run, so Prepend reproduces that;
    # Metaspace would not (it skips the prefix when the text starts with "▁").
    steps = [normalizers.Replace(" ", "▁")]
    add_space_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    chain = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(chain)
    return backend


def _score_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens, best score first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose joined text is the
    token with the highest score; ranking merges by that score makes BPE do the same.
    """
    ranked = []
    for token, token_id in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _add_special_tokens(backend: Backend, tokens: list[str], token_types: list[int] | None) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both are matched
    whole in the input text (never split), as llama.cpp does; only control tokens are skipped on decode."""
    if not token_types:
        return
    control = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_CONTROL and t]
    user = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_USER_DEFINED and t]
    if control:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
