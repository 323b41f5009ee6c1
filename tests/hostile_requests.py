"""Requests a hostile or careless client sends, each with the 4xx it must get.

Used by test_server.py against a real server (`--max-context 1024 --max-body-bytes 65536`
and an API key): every one gets its status with an OpenAI-shaped error body, and the
next normal request still succeeds. Classes: numbers out of range, wrong types, Unicode
edge cases, nesting, sizes, unsupported fields, routes and methods, and the guard (key,
Host, Origin).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Hostile:
    kind: str                 # the class of the attack
    name: str
    status: int
    body: bytes | None = None
    path: str = CHAT
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    auth: bool = True         # send the right API key


def chat(**fields) -> bytes:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps({**base, **fields}).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}).encode()


def raw_chat(fragment: str) -> bytes:
    """A chat body with `fragment` spliced in as written (JSON the encoder would not make)."""
    return (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
            f'{fragment}}}').encode()


def _numbers() -> list[Hostile]:
    out = []
    for name, value in [("temperature", -0.5), ("temperature", 2.5), ("top_p", 0),
                        ("top_p", 1.5), ("top_k", 2 ** 31), ("top_k", 10 ** 30), ("top_k", -2),
                        ("min_p", 1.5), ("min_p", -0.1), ("max_tokens", 0), ("max_tokens", -5),
                        ("max_tokens", 2 ** 31), ("max_tokens", 10 ** 30), ("n", 0), ("n", 129),
                        ("seed", 2 ** 64), ("seed", -(2 ** 64)), ("top_logprobs", 21),
                        ("presence_penalty", 3), ("frequency_penalty", -2.5),
                        ("max_completion_tokens", 0)]:
        extra = {"logprobs": True} if name == "top_logprobs" else {}
        out.append(Hostile("number out of range", f"{name}={value}", 400,
                           chat(**{name: value}, **extra)))
    out += [
        Hostile("number out of range", "temperature=1e999 (inf)", 400,
                raw_chat('"temperature": 1e999')),
        Hostile("number out of range", "temperature=NaN literal", 400,
                raw_chat('"temperature": NaN')),
        Hostile("number out of range", "top_p=-Infinity literal", 400,
                raw_chat('"top_p": -Infinity')),
        Hostile("number out of range", "max_tokens with 5000 digits", 400,
                raw_chat('"max_tokens": ' + "9" * 5000)),
        Hostile("number out of range", "logit_bias 101", 400, chat(logit_bias={"42": 101})),
        Hostile("number out of range", "logit_bias -1e308", 400, chat(logit_bias={"42": -1e308})),
        Hostile("number out of range", "logit_bias token outside the vocabulary", 400,
                chat(logit_bias={"999999": 1})),
        Hostile("number out of range", "logprobs=21 (completions)", 400, completion(logprobs=21),
                COMPLETIONS),
        Hostile("number out of range", "prompt token id -1", 400, completion(prompt=[1, -1]),
                COMPLETIONS),
        Hostile("number out of range", "prompt token id past the vocabulary", 400,
                completion(prompt=[1, 10 ** 6]), COMPLETIONS),
        Hostile("number out of range", "max_tokens beyond the context", 400, chat(max_tokens=1020)),
    ]
    return out


def _types() -> list[Hostile]:
    cases = [("max_tokens", "16"), ("max_tokens", 16.5), ("max_tokens", True), ("stream", "yes"),
             ("stream", 1), ("temperature", "0.5"), ("temperature", [0.5]), ("n", "2"),
             ("seed", 1.5), ("stop", 5), ("stop", [1, 2]), ("logit_bias", []),
             ("logit_bias", {"1": "x"}), ("logit_bias", {"a": 1}), ("stream_options", "yes"),
             ("stream_options", {"include_usage": "yes"}), ("model", 5), ("messages", "hi"),
             ("messages", [1]), ("messages", [{"role": 5, "content": "hi"}]),
             ("messages", [{"role": "user", "content": 5}]),
             ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
             ("messages", [{"content": "hi"}]), ("logprobs", "true"), ("top_logprobs", "2")]
    out = [Hostile("wrong type", f"{name}={json.dumps(value)}", 400, chat(**{name: value}))
           for name, value in cases]
    out += [Hostile("wrong type", f"prompt={json.dumps(p)}", 400, completion(prompt=p), COMPLETIONS)
            for p in (5, [1.5], [True], [[1, "a"]], {"text": "hi"})]
    out += [Hostile("wrong type", "echo='no'", 400, completion(echo="no"), COMPLETIONS)]
    return out


def _unicode() -> list[Hostile]:
    return [
        Hostile("unicode", "lone surrogate in content", 400,
                raw_chat('"stop": "x"').replace(b'"hi"', b'"hi \\ud800"')),
        Hostile("unicode", "lone low surrogate in the model name", 400,
                raw_chat('"max_tokens": 2').replace(MODEL.encode(), b"\\udc00")),
        Hostile("unicode", "lone surrogate in a key", 400, raw_chat('"\\udbff": 1')),
        Hostile("unicode", "lone surrogate in a stop string", 400, raw_chat('"stop": ["\\ud834"]')),
        Hostile("unicode", "lone surrogate in a completion prompt", 400,
                b'{"model": "%s", "prompt": "a\\udfffb"}' % MODEL.encode(), COMPLETIONS),
        Hostile("unicode", "invalid UTF-8 bytes", 400, chat().replace(b'"hi"', b'"hi \xff\xfe"')),
        Hostile("unicode", "overlong UTF-8 encoding", 400, chat().replace(b'"hi"', b'"\xc0\xaf"')),
        Hostile("unicode", "high surrogate before a letter", 400,
                raw_chat('"stop": "\\ud83d\\u0041"')),
        Hostile("unicode", "truncated UTF-8 sequence", 400, chat().replace(b'"hi"', b'"\xe2\x82"')),
    ]


def _nesting() -> list[Hostile]:
    def nested(depth: int) -> str:
        return "[" * depth + "]" * depth
    return [
        Hostile("nesting", "30000 nested arrays", 400, raw_chat(f'"x": {nested(30000)}')),
        Hostile("nesting", "65 nested arrays", 400, raw_chat(f'"x": {nested(65)}')),
        Hostile("nesting", "deep object in a message", 400, json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi",
                                          "extra": json.loads('{"a":' * 70 + '1' + '}' * 70)}]
        }).encode()),
        Hostile("nesting", "unclosed arrays", 400, raw_chat(f'"x": {"[" * 5000}')),
    ]


def _sizes() -> list[Hostile]:
    return [
        Hostile("size", "body over --max-body-bytes", 413, chat(stop="x" * 70000)[:66000] + b'"}'),
        Hostile("size", "17 stop strings", 400, chat(stop=["s"] * 17)),
        Hostile("size", "a 1001-character stop string", 400, chat(stop="s" * 1001)),
        Hostile("size", "1025 logit biases", 400,
                chat(logit_bias={str(i): 1 for i in range(1025)})),
        Hostile("size", "prompt longer than the context", 400, chat(messages=[
            {"role": "user", "content": "word " * 1500}])),
        Hostile("size", "empty messages", 400, chat(messages=[])),
        Hostile("size", "empty prompt", 400, completion(prompt=""), COMPLETIONS),
        Hostile("size", "two prompts", 400, completion(prompt=["a", "b"]), COMPLETIONS),
        Hostile("size", "empty body", 400, b""),
        Hostile("size", "body is a list", 400, b"[]"),
        Hostile("size", "body is null", 400, b"null"),
        Hostile("size", "body is a string", 400, b'"hi"'),
        Hostile("size", "truncated JSON", 400, chat()[:-5]),
    ]


def _unsupported() -> list[Hostile]:
    return [
        Hostile("unsupported", "tools", 400, chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])),
        Hostile("unsupported", "tool_choice required", 400, chat(tool_choice="required")),
        Hostile("unsupported", "functions", 400, chat(functions=[{"name": "f"}])),
        Hostile("unsupported", "response_format json_object", 400,
                chat(response_format={"type": "json_object"})),
        Hostile("unsupported", "presence_penalty 0.5", 400, chat(presence_penalty=0.5)),
        Hostile("unsupported", "top_logprobs without logprobs", 400, chat(top_logprobs=2)),
        Hostile("unsupported", "image content part", 400, chat(messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])),
        Hostile("unsupported", "role wizard", 400,
                chat(messages=[{"role": "wizard", "content": "hi"}])),
        Hostile("unsupported", "reasoning_effort extreme", 400, chat(reasoning_effort="extreme")),
        Hostile("unsupported", "echo", 400, completion(echo=True), COMPLETIONS),
        Hostile("unsupported", "best_of 2", 400, completion(best_of=2), COMPLETIONS),
        Hostile("unsupported", "suffix", 400, completion(suffix="x"), COMPLETIONS),
    ]


def _routes() -> list[Hostile]:
    return [
        Hostile("route", "unknown model", 404, chat(model="gpt-9")),
        Hostile("route", "unknown route", 404, b"{}", "/v1/nothing"),
        Hostile("route", "unknown route without /v1", 404, None, "/admin", "GET"),
        Hostile("route", "GET on chat", 405, None, CHAT, "GET"),
        Hostile("route", "PUT on completions", 405, completion(), COMPLETIONS, "PUT"),
        Hostile("route", "DELETE on models", 405, None, "/v1/models", "DELETE"),
        Hostile("route", "POST on health", 405, b"{}", "/health"),
        Hostile("route", "unknown model card", 404, None, "/v1/models/gpt-9", "GET"),
    ]


def _guard() -> list[Hostile]:
    return [
        Hostile("guard", "no API key", 401, chat(), auth=False),
        Hostile("guard", "wrong API key", 401, chat(), auth=False,
                headers={"Authorization": "Bearer sk-wrong"}),
        Hostile("guard", "Basic scheme", 401, chat(), auth=False,
                headers={"Authorization": "Basic c2stdGVzdA=="}),
        Hostile("guard", "key prefix only", 401, chat(), auth=False,
                headers={"Authorization": "Bearer sk-tes"}),
        Hostile("guard", "Host of another site (DNS rebinding)", 403, chat(),
                headers={"Host": "attacker.example"}),
        Hostile("guard", "Host of another site on /health", 403, None, "/health", "GET",
                headers={"Host": "attacker.example:8000"}),
        Hostile("guard", "cross-origin browser POST", 403, chat(),
                headers={"Origin": "http://attacker.example"}),
        Hostile("guard", "null origin", 403, chat(), headers={"Origin": "null"}),
    ]


HOSTILE = _numbers() + _types() + _unicode() + _nesting() + _sizes() + _unsupported() + \
    _routes() + _guard()
