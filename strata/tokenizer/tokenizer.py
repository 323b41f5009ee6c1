"""The model's tokenizer: text to token ids and back, its special tokens and its chat template.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built either from a GGUF file's metadata
(`from_gguf`, see gguf_vocab.py) or from a Hugging Face model folder (`from_hf_folder`). It owns
the model's BOS/EOS policy: whether encode() adds BOS, and which ids end generation.

It does not stream text (detokenize.py) and it is not used by the engine, which sees only ids.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as Backend

from strata.errors import StrataError
from strata.tokenizer.chat import render_chat
from strata.tokenizer.gguf_vocab import LLAMA3_PRE, TOKEN_CONTROL, build_gguf_backend

# Special tokens that end a turn in common chat formats. As llama.cpp does, any of these that the
# vocabulary has as a special (control) token also ends generation, besides the declared EOS.
END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<EOT>",
    "<|return|>",
    "<｜end▁of▁sentence｜>",
)


# Chat template variable -> GGUF key of its token id.
_GGUF_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


class Tokenizer:
    """Encode/decode text for one model; build it with `from_gguf` or `from_hf_folder`."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None,
        special_tokens: dict[str, str],
        vocab_size: int | None = None,
        tokens: list[str] | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        if vocab_size is None:
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size
        # NOTE: passed to chat templates as bos_token, eos_token, unk_token, pad_token (as transformers does).
        self._special_tokens = special_tokens
        # NOTE: a GGUF may spell two ids alike; the backend knows only the first, this list knows all.
        self._tokens = tokens
        # Ids encode() puts around the text, besides whatever the backend's own post-processor adds.
        self._prefix = [bos_token_id] if add_bos and bos_token_id is not None else []
        # NOTE: the declared EOS is first in eos_token_ids.
        self._suffix = [eos_token_ids[0]] if add_eos and eos_token_ids else []

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, fields: dict) -> Tokenizer:
        """From GGUF metadata as plain values (see gguf_vocab.read_gguf_fields)."""
        backend = build_gguf_backend(fields)
        tokens = fields["tokenizer.ggml.tokens"]

        def token_id(key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
        model = fields["tokenizer.ggml.model"]
        # llama.cpp's defaults when the file does not say: BOS for SentencePiece and Llama-3 vocabularies.
        default_bos = model == "llama" or fields.get("tokenizer.ggml.pre") in LLAMA3_PRE

        types = fields.get("tokenizer.ggml.token_type") or []
        control = {tokens[i] for i, kind in enumerate(types) if kind == TOKEN_CONTROL}
        declared = [eos, token_id("eot_token_id"), token_id("eom_token_id")]
        eos_ids = _end_ids(declared, control, backend)
        special = {name: tokens[i] for name, key in _GGUF_SPECIAL.items() if (i := token_id(key)) is not None}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=fields.get("tokenizer.chat_template") or None,
            special_tokens=special,
            vocab_size=len(tokens),
            tokens=tokens,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", default_bos)),
            add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos is not None,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face model folder: tokenizer.json, tokenizer_config.json, chat_template.jinja,
        generation_config.json."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise StrataError(
                f"no tokenizer.json in {str(folder)!r}; point to a Hugging Face model folder that has one"
            )
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[name] = value
        bos = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        eos = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
        # As transformers: explicit add_bos_token/add_eos_token flags replace tokenizer.json's post-processor.
        flags = "add_bos_token" in config or "add_eos_token" in config
        if flags:
            backend.post_processor = None

        declared = [eos]
        configured = generation.get("eos_token_id")
        declared += configured if isinstance(configured, list) else [configured]
        control = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=_end_ids(declared, control, backend),
            chat_template=_hf_chat_template(folder, config),
            special_tokens=special,
            add_bos=flags and bool(config.get("add_bos_token", False)),
            add_eos=flags and bool(config.get("add_eos_token", False)) and eos is not None,
        )

    # ---- use ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole. BOS/EOS are added
        only when `add_special_tokens` and the model asks for them."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and (self._prefix or self._suffix):
            ids = self._prefix + ids + self._suffix
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of `messages` through the chat template. Message contents are the user's
        text: a special token written in them (`<|im_end|>`) is encoded as plain text, never
        as the control token, while the template's own special tokens stay special."""
        specials = self._special_texts
        risky = [i for i, m in enumerate(messages)
                 if isinstance(m.get("content"), str) and any(t in m["content"] for t in specials)]
        if not risky:
            text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
            return self.encode(text, add_special_tokens=False)
        # Mark the risky contents, render, then encode the marked parts without special tokens.
        mark = f"\ue000{secrets.token_hex(8)}\ue001"
        marked = [dict(m, content=f"{mark}{m['content']}{mark}") if i in risky else m
                  for i, m in enumerate(messages)]
        text = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, **kwargs)
        parts = text.split(mark)
        if len(parts) % 2 == 0 or any(mark[1:-1] in p for p in parts):
            raise StrataError("the chat template changed a message's text in a way that hides which "
                              "part is the message; remove special-token text from the messages")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if part:
                backend = self._plain_backend if i % 2 else self._backend
                ids += backend.encode(part, add_special_tokens=False).ids
        return ids

    @cached_property
    def _special_texts(self) -> list[str]:
        """Texts of the added (special and control) tokens."""
        return [t.content for t in self._backend.get_added_tokens_decoder().values() if t.content]

    @cached_property
    def _plain_backend(self) -> Backend:
        """A copy of the backend that encodes special-token text as ordinary text."""
        backend = Backend.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (a piece of UTF-8 text, possibly incomplete)."""
        token = self.id_to_token(i)
        if self._byte_level:
            if all(c in _BYTE_OF_CHAR for c in token):
                return bytes(_BYTE_OF_CHAR[c] for c in token)
            return token.encode()
        if match := _BYTE_TOKEN.fullmatch(token):
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    @cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        return "ByteLevel" in json.dumps(decoder)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        if self._tokens is not None:
            token = self._tokens[i] if 0 <= i < len(self._tokens) else None
        else:
            token = self._backend.id_to_token(i)
        if token is None:
            raise StrataError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages`, rendered as transformers would; kwargs reach the template
        (tools, enable_thinking, ...) and override the special token names."""
        if not self.chat_template:
            raise StrataError("this model has no chat template; use --raw to send the prompt text as is")
        variables = {**self._special_tokens, **kwargs}
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _end_ids(declared: list[int | None], special_texts: set[str], backend: Backend) -> list[int]:
    """Declared end ids first, then the vocabulary's special end-of-turn tokens; no duplicates."""
    ids = [i for i in declared if isinstance(i, int)]
    for text in END_OF_TURN_TOKENS:
        if text in special_texts and (i := backend.token_to_id(text)) is not None:
            ids.append(i)
    return list(dict.fromkeys(ids))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise StrataError(f"{str(path)!r} is not valid JSON ({exc}); fix or re-download it") from exc


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
