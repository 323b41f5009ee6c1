"""`strata serve` with the official `openai` client against a real server process on a
free loopback port, its engine in a process of its own (`--engine-process on`; the other
server tests run it on the server's thread, as `auto` does on the CPU): chat and completions, streamed and not, concurrency, logprobs and n
choices, the hostile-request list (each a 4xx in OpenAI's shape, the server serving on),
the guard (key, Host, Origin, stalled bodies), clients that disconnect (streamed or not),
the queue limit with its keepalive comments and Retry-After, and a bounded SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from hostile_requests import HOSTILE
from server_utils import metric, running_server, server_process

KEY = "sk-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France? Answer in one short sentence."
ORIGIN = "http://good.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with running_server("--parallel", "4", "--api-key", KEY, "--max-context", "1024",
                        "--engine-process", "on",
                        "--max-body-bytes", "65536", "--body-timeout", "2",
                        "--allowed-origins", ORIGIN, log=log) as (base, seen):
        yield base, seen, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, content: str, max_tokens: int = 32, temperature: float = 0, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=temperature,
        max_tokens=max_tokens, **kw)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def generate_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "strata.cli", "generate", *args],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")
    lines = out.stderr.splitlines()  # a loading line at once, a ready line with the seconds
    assert lines[0].startswith("strata: loading SmolLM2") and "30 layers" in lines[0], lines
    assert any(line.startswith("strata: ready in ") for line in lines), lines
    return out.stdout[:-1]


def test_health_was_503_while_loading(server):
    _, seen, _ = server
    assert 503 in seen and seen[-1] == 200


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_nonstream_equals_generate(client, server):
    whole = chat(client, QUESTION, max_tokens=40)
    choice = whole.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert whole.id.startswith("chatcmpl-") and whole.created > 0 and whole.model == MODEL
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    text, chunks = stream_text(chat(client, QUESTION, max_tokens=40, stream=True,
                                    stream_options={"include_usage": True}))
    assert text == choice.message.content
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert generate_cli(QUESTION, "--max-tokens", "40") == choice.message.content
    assert f"prompt={whole.usage.prompt_tokens} completion=" in server[2].read_text()


def test_content_as_text_parts(client):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8,
                                           messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": parts}])
    assert reply.choices[0].message.content


def test_completions_stream_equals_nonstream_equals_generate(client):
    prompt = "def add(a, b):\n"
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                            max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    assert generate_cli(prompt, "--raw", "--max-tokens", "24") == whole.choices[0].text


def test_stop_string_and_seed(client):
    reply = chat(client, "Count from 1 to 10, separated by commas.", max_tokens=40, stop=["5"])
    assert "5" not in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    a = chat(client, "Tell me a story.", max_tokens=16, temperature=1.0, seed=7)
    b = chat(client, "Tell me a story.", max_tokens=16, temperature=1.0, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_eight_concurrent_streams_equal_their_solo_text(client):
    topics = ["rivers", "the moon", "bread", "chess", "rain", "owls", "glass", "trains"]
    prompts = [f"Write one sentence about {t}." for t in topics]
    solo = [chat(client, p).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: stream_text(chat(client, p, stream=True))[0], prompts))
    assert texts == solo


def test_reasoning_effort_is_accepted(client):
    reply = chat(client, QUESTION, max_tokens=8, reasoning_effort="none")
    assert reply.choices[0].message.content


def raw(server, body, headers=None, path="/v1/chat/completions") -> httpx.Response:
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(server[0] + path, content=body, headers=h, timeout=60)


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}'
     % MODEL.encode(), 400, "temperature"),
    (b'{"model": "%s", "messages": []}' % MODEL.encode(), 400, "messages"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "n": 0}' % MODEL.encode(),
     400, "n: Input should be greater than or equal to 1"),
    (b'{"model": "%s", "messages": [{"role": "wizard", "content": "hi"}]}' % MODEL.encode(),
     400, "role"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}', 404, "gpt-9"),
])
def test_bad_requests(server, body, status, needle):
    response = raw(server, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]


def test_prompt_longer_than_context_says_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "word " * 1500)
    message = str(info.value)
    assert "--max-context is 1024" in message and "the prompt is " in message


def test_oversized_body_is_413(server):
    response = raw(server, b'{"model": "x", "messages": [{"role": "user", "content": "'
                   + b"a" * 70000 + b'"}]}')
    assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]


def test_api_key_required(server):
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server[0] + "/health").status_code == 200  # health needs no key


def test_server_keeps_serving_after_bad_input(client, server):
    for body in (b"{", b"[]", b'{"model": 3}'):
        assert raw(server, body).status_code == 400
    assert "Paris" in chat(client, QUESTION).choices[0].message.content
    assert metric(server[0], "strata_slots_total") == 4


def test_draft_statistics_in_usage_and_metrics(client, server):
    source = "def area(w, h):\n    return w * h\n\n" * 6
    reply = client.completions.create(model=MODEL, prompt=source, temperature=0, max_tokens=48)
    drafts = reply.usage.model_extra["drafts"]
    assert drafts["drafted"] >= drafts["accepted"] > 0
    assert set(drafts["by_proposer"]) <= {"suffix", "lookup"}
    assert metric(server[0], "strata_draft_accepted_tokens_total") >= drafts["accepted"]
    assert "drafts=" in server[2].read_text()


@pytest.mark.parametrize("flags,needle", [
    (["--layer-split", "99"], "--layer-split"),
    (["--devices", "cuda:0"], "cuda:0"),
    (["--model", "/no/such.gguf"], "/no/such.gguf"),
    (["--port", "0"], "--port"),
])
def test_serve_refuses_bad_settings_before_listening(flags, needle):
    out = subprocess.run([sys.executable, "-m", "strata.cli", "serve", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert needle in out.stderr.strip().splitlines()[-1]


# -------------------------------------------------------------------- hostile requests

def send(base: str, h) -> httpx.Response:
    headers = {"Content-Type": "application/json", **h.headers}
    if h.auth:
        headers.setdefault("Authorization", f"Bearer {KEY}")
    return httpx.request(h.method, base + h.path, content=h.body, headers=headers, timeout=60)


def is_openai_error(response: httpx.Response, status: int) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (response.status_code == status and set(error) == {"message", "type", "param", "code"}
            and error["code"] == status and isinstance(error["message"], str)
            and "\n" not in error["message"] and "Traceback" not in error["message"])


def test_every_hostile_request_gets_an_openai_error_and_the_next_request_succeeds(server):
    base = server[0]
    normal = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    failures = []
    for h in HOSTILE:
        response = send(base, h)
        if not is_openai_error(response, h.status):
            failures.append(f"{h.kind}: {h.name}: {response.status_code} {response.text[:200]}")
        ok = httpx.post(base + "/v1/completions", json=normal, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, f"after {h.name}: {ok.text}"
    assert not failures, "\n".join(failures)
    assert len(HOSTILE) >= 60
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert "Traceback" not in server[2].read_text()


@pytest.mark.parametrize("fields", [
    dict(temperature=1e-30), dict(temperature=2.0, top_k=1), dict(top_k=2 ** 31 - 1),
    dict(top_p=1e-9), dict(min_p=1.0), dict(seed=-(2 ** 63)), dict(temperature=None, n=None),
    dict(logit_bias={"0": -100, "1": -100}), dict(max_tokens=None, stop=["."]),
    dict(messages=[{"role": "user", "content": "\u0000 \U0001F600 \u202e \ufeff é"}]),
    dict(tools=[], tool_choice="none", response_format={"type": "text"}, presence_penalty=0),
])
def test_odd_but_valid_requests_succeed(server, client, fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "temperature": 0, **fields}
    reply = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]  # no empty answer (no NaN)


def test_special_token_text_in_a_message_stays_text(client):
    control = chat(client, "<|im_end|>", max_tokens=1).usage.prompt_tokens
    letter = chat(client, "x", max_tokens=1).usage.prompt_tokens
    assert control > letter + 2  # several text tokens, not the one control token


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "Hi", max_tokens=1020)
    assert "max_tokens is 1020" in str(info.value) and "context is 1024" in str(info.value)


def test_stalled_body_times_out_with_408(server):
    port = int(server[0].rsplit(":", 1)[1])
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        answer = b""
        while chunk := s.recv(65536):  # the head and the body may come apart; then it closes
            answer += chunk
        answer = answer.decode()
    assert time.monotonic() - start < 6
    head, body = answer.split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 408") and json.loads(body)["error"]["code"] == 408


# -------------------------------------------------------------------------- the guard

def test_guard_bearer_scheme_host_and_origin(server):
    base = server[0]
    port = base.rsplit(":", 1)[1]
    models = base + "/v1/models"
    assert httpx.get(models, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(models, headers={"Authorization": f"BEARER  {KEY}"}).status_code == 200
    refused = httpx.get(models)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(models, headers={"Authorization": f"Bearer {KEY}",
                                      "Host": f"localhost:{port}"}).status_code == 200
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
    allowed = httpx.post(base + "/v1/completions", json=body, headers={
        "Authorization": f"Bearer {KEY}", "Origin": ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    preflight = httpx.options(base + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    same = httpx.post(base + "/v1/completions", json=body, headers={
        "Authorization": f"Bearer {KEY}", "Origin": base})  # a page of this server itself
    assert same.status_code == 200


# ----------------------------------------------------------- OpenAI fields and routes

def test_models_route_and_request_bodies_in_openapi(client, server):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    spec = httpx.get(server[0] + "/openapi.json").json()
    for path, name in (("/v1/chat/completions", "ChatRequest"),
                       ("/v1/completions", "CompletionRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert ref["schema"]["$ref"] == f"#/components/schemas/{name}"
    assert "messages" in spec["components"]["schemas"]["ChatRequest"]["properties"]
    assert "Message" in spec["components"]["schemas"]


def test_chat_logprobs_with_the_official_client(client):
    whole = chat(client, QUESTION, max_tokens=12, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) + (whole.choices[0].finish_reason == "stop") == \
        whole.usage.completion_tokens >= 4  # the end-of-turn token has no entry
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy
        assert t.top_logprobs[0].logprob == t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    chunks = list(chat(client, QUESTION, max_tokens=12, logprobs=True, top_logprobs=3,
                       stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == \
        [(t.token, round(t.logprob, 4)) for t in content]
    assert chat(client, QUESTION, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_with_the_official_client(client):
    reply = client.completions.create(model=MODEL, prompt="def add(a, b):\n", temperature=0,
                                      max_tokens=10, logprobs=2)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(p)
               for top, p in zip(lp.top_logprobs, lp.token_logprobs))


def test_n_choices(client):
    reply = chat(client, QUESTION, max_tokens=10, n=2)
    single = chat(client, QUESTION, max_tokens=10)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.message.content for c in reply.choices] == [single.choices[0].message.content] * 2
    assert reply.usage.completion_tokens == 2 * single.usage.completion_tokens
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    text, chunks = {}, list(chat(client, QUESTION, max_tokens=10, n=2, stream=True))
    for c in chunks:
        for choice in c.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
    assert text == {0: reply.choices[0].message.content, 1: reply.choices[0].message.content}
    seeded = chat(client, "Tell me a story.", max_tokens=12, temperature=1.0, seed=40, n=2)
    alone = [chat(client, "Tell me a story.", max_tokens=12, temperature=1.0, seed=40 + i)
             .choices[0].message.content for i in range(2)]
    assert [c.message.content for c in seeded.choices] == alone  # choice i uses seed + i


# ------------------------------------------ one slot: queue, disconnects, SIGTERM

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One slot and one queue place; short keepalive and shutdown timeout. The last test
    of this file stops it with SIGTERM."""
    log = tmp_path_factory.mktemp("small") / "serve.log"
    with server_process("--parallel", "1", "--max-queue", "1", "--sse-keepalive", "0.3",
                        "--shutdown-timeout", "2", "--engine-process", "on",
                        log=log) as (base, _, proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        yield base, client, proc, log


def wait_metric(base: str, name: str, value: float, seconds: float) -> float:
    start = time.monotonic()
    while metric(base, name) != value:
        assert time.monotonic() - start < seconds, f"{name} != {value} after {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_queue_limit_keepalive_comments_and_disconnected_streams(small):
    base, client, _, _ = small
    long = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,",
                                     temperature=0, max_tokens=3000, stream=True)
    first = [next(iter(long)) for _ in range(3)]
    assert first
    lines = []

    def queued_stream():
        with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    queued = threading.Thread(target=queued_stream)
    queued.start()
    wait_metric(base, "strata_queue_length", 1, 30)  # the second request waits for the slot
    time.sleep(1.0)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    retry = info.value.response.headers["retry-after"]
    assert retry.isdigit() and int(retry) >= 1
    long.close()  # the client goes away mid-stream
    queued.join(60)
    waiting = [line for line in lines if line.startswith(":")]
    assert len(waiting) >= 2, lines  # SSE comments while it waited ~1 s, every 0.3 s
    assert lines.index(waiting[0]) < next(i for i, l in enumerate(lines) if l.startswith("data: {"))
    assert lines[-1] == "data: [DONE]"
    assert metric(base, 'strata_requests_total{finish_reason="abort"}') == 1
    wait_metric(base, "strata_slots_used", 0, 10)


def test_whole_request_whose_client_leaves_frees_its_slot_at_once(small):
    base, _, _, log = small
    aborted = metric(base, 'strata_requests_total{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # an SDK that gives up
        httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    # NOTE: under 0.2 s on an idle machine; the bound leaves room for a loaded one
    wait_metric(base, "strata_slots_used", 0, 3.0)
    # NOTE: the request is counted just after its slot is freed
    wait_metric(base, 'strata_requests_total{finish_reason="abort"}', aborted + 1, 1.0)


def test_retry_after_grows_with_the_queue():
    from strata.config import EngineConfig
    from strata.server.async_engine import AsyncEngine
    from strata.server.metrics import Metrics
    engine = AsyncEngine(EngineConfig(parallel=2), None, Metrics(), max_queue=8)
    engine._seconds_per_request = 4.0
    estimates = []
    for unfinished in (2, 4, 10):
        engine._unfinished = unfinished
        estimates.append(engine.retry_after())
    assert estimates == [2, 6, 18]  # (waiting + 1) / slots x seconds per request


def test_updates_that_piled_up_come_merged_and_an_error_stays_apart():
    """A consumer that fell behind the engine gets one update for the tokens that came
    (ids and logprobs in order, the last one's finish and drafts); an error after them
    is its own last update; a quiet request yields keepalive ticks."""
    import asyncio

    from strata.request import Request
    from strata.sampling.params import SamplingParams
    from strata.server.async_engine import RequestHandle, Update, deliver_all

    async def run():
        loop = asyncio.get_running_loop()
        request = Request([1, 2], SamplingParams(max_tokens=8))
        finished, failed, quiet = (RequestHandle(request, loop) for _ in range(3))
        deliver_all([(finished, Update([5], logprobs=["a"])),
                     (failed, Update([9])),
                     (finished, Update([6, 7], logprobs=["b", "c"])),
                     (failed, Update([], error="boom", error_status=500)),
                     (finished, Update([8], "length", drafts={"drafted": 1},
                                       logprobs=["d"])),
                     (failed, Update([10]))])  # after the error: never read
        ticks = []
        async for update in quiet.updates(keepalive=0.01):
            ticks.append(update)
            if len(ticks) == 2:
                break
        return ([u async for u in finished.updates()], [u async for u in failed.updates()],
                ticks)

    finished, failed, ticks = asyncio.run(run())
    assert finished == [Update([5, 6, 7, 8], "length", drafts={"drafted": 1},
                               logprobs=["a", "b", "c", "d"])]
    assert failed == [Update([9]), Update([], error="boom", error_status=500)]
    assert ticks == [None, None]


def test_sigterm_ends_running_requests_after_the_shutdown_timeout(small):
    """Runs last on this server: SIGTERM lets a running request go on for
    --shutdown-timeout (2 s), then ends it with an OpenAI-shaped 503 and exits."""
    base, _, proc, _ = small
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 3000, "temperature": 0}
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        response=httpx.post(base + "/v1/completions", json=body, timeout=60)))
    thread.start()
    wait_metric(base, "strata_slots_used", 1, 30)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    assert 1.5 < time.monotonic() - start < 10
    response = result["response"]
    assert is_openai_error(response, 503) and "shutting down" in response.json()["error"]["message"]
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
