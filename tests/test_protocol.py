"""Request bodies: what ChatRequest and CompletionRequest accept, refuse, and how chat
messages reach the template (text parts, developer role, reasoning_effort)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from strata.server.protocol import ChatRequest, CompletionRequest

QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


class TemplateOnly:
    """Just enough tokenizer for prompt_text: a template and the shared renderer."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        from strata.tokenizer.chat import render_chat
        return render_chat(self.chat_template, messages,
                           add_generation_prompt=add_generation_prompt, **kwargs)


def chat(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        **kw})


@pytest.mark.parametrize("effort,thinking_off", [(None, False), ("none", True), ("low", True),
                                                 ("medium", False), ("high", False)])
def test_reasoning_effort_switches_qwen3_thinking(effort, thinking_off):
    text = chat(reasoning_effort=effort).prompt_text(TemplateOnly(QWEN3_LIKE))
    assert ("<think>" in text) == thinking_off
    assert "<|im_start|>system\nBe brief." in text and "a\nb" in text


def test_reasoning_effort_without_a_switch_changes_nothing():
    template = QWEN3_LIKE.replace("enable_thinking", "never_set")
    plain = chat().prompt_text(TemplateOnly(template))
    assert chat(reasoning_effort="none").prompt_text(TemplateOnly(template)) == plain


def test_sampling_fields_map_to_params():
    req = chat(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop="END",
               max_tokens=50, max_completion_tokens=20)
    params = req.sampling_params(req.max_new_tokens)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed,
            params.stop, params.max_tokens) == (0.5, 0.9, 5, 0.1, 3, ("END",), 20)


@pytest.mark.parametrize("bad", [dict(n=3), dict(temperature="hot"), dict(messages=[]),
                                 dict(reasoning_effort="extreme"), dict(max_tokens=0),
                                 dict(messages=[{"role": "user", "content": [
                                     {"type": "image_url", "image_url": {"url": "x"}}]}])])
def test_bad_chat_fields(bad):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad}
    with pytest.raises(ValidationError):
        ChatRequest.model_validate(body)


def test_completion_prompts():
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).max_tokens == 16
    for bad in (["a", "b"], "", []):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})
