"""The OpenAI request bodies Strata accepts, checked with pydantic.

Types are strict (no "16" for 16, no "yes" for true) and every number has bounds: OpenAI's
ranges where it has them, finite and representable values everywhere else. Unknown fields
are ignored (clients send many); fields Strata knows but does not implement (tools,
response_format, echo, ...) are a 400 when set to anything but their no-op value, so that
nothing a client asks for is silently dropped.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from strata.sampling.params import INT32, INT64, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

STRICT = ConfigDict(strict=True, extra="ignore")
MAX_STOP = 16           # stop strings per request
MAX_STOP_CHARS = 1000   # characters of one stop string
MAX_N = 128             # choices per request (OpenAI's bound)
MAX_LOGIT_BIASES = 1024

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenCount = Annotated[int, Field(ge=1, lt=INT32)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        out.update(role="system" if self.role == "developer" else self.role,
                   content=content or "")
        return out


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


def _unsupported(field: str, value, why: str = "") -> ValueError:
    return ValueError(f"'{field}' is not supported by this server{why}; leave it out")


class _Sampling(BaseModel):
    model_config = STRICT
    model: str = Field(max_length=1000)
    max_tokens: TokenCount | None = None
    temperature: Finite = Field(default=1.0, ge=0, le=2)
    top_p: Finite = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, lt=INT32)  # extension (vLLM): 0 or -1 = off
    min_p: Finite = Field(default=0.0, ge=0, le=1)  # extension (vLLM, llama.cpp)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: StopString | list[StopString] | None = Field(default=None, max_length=MAX_STOP)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Finite] | None = Field(default=None, max_length=MAX_LOGIT_BIASES)
    presence_penalty: Finite | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Finite | None = Field(default=None, ge=-2, le=2)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """`"temperature": null` means the default, as in OpenAI's API."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None):
        for key, value in (bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys must be token ids written as strings (got '{key[:20]}')")
            if abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                                 f" (got {value} for token {key})")
        return bias

    @model_validator(mode="after")
    def _no_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(name, getattr(self, name), " (only 0)")
        return self

    def sampling_params(self, max_tokens: int | None,
                        logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), min_p=self.min_p, seed=self.seed,
                              max_tokens=max_tokens, stop=tuple(s for s in stop if s),
                              logprobs=logprobs, logit_bias=bias)

    def choices(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per choice: a seeded request's choice i uses seed + i, so
        choices differ and each is reproducible."""
        if params.seed is None:
            return [params] * self.n
        return [replace(params, seed=(params.seed + i + INT64) % (2 * INT64) - INT64)
                for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise _unsupported(name, None, " (no tool calling yet)")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise _unsupported(name, None, " (no tool calling yet)")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise _unsupported("response_format", None, " (only {\"type\": \"text\"}: no "
                               "JSON mode or schemas yet)")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages]

    def template_options(self, tokenizer) -> dict:
        """`reasoning_effort` none or low turns thinking off where the template has
        Qwen3's `enable_thinking` switch."""
        if self.reasoning_effort in ("none", "low") and "enable_thinking" in (
                tokenizer.chat_template or ""):
            return {"enable_thinking": False}
        return {}

    def prompt_text(self, tokenizer) -> str:
        """The messages through the model's chat template."""
        return tokenizer.apply_chat_template(self.template_messages(), add_generation_prompt=True,
                                             **self.template_options(tokenizer))


TokenId = Annotated[int, Field(ge=0, lt=INT32)]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported; send one "
                                 "request per prompt")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _supported(self):
        if self.echo:
            raise _unsupported("echo", True, " (only false)")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", self.best_of, " (only equal to n)")
        if self.suffix:
            raise _unsupported("suffix", self.suffix, " (no fill-in-the-middle yet)")
        return self
