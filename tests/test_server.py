"""`strata serve` with the official `openai` client against a real server process on a
free loopback port: chat and completions, streamed and not, concurrency, a client that
disconnects, the queue limit, and every bad input getting its status and message."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_utils import metric, running_server

KEY = "sk-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with running_server("--parallel", "4", "--api-key", KEY, "--max-context", "1024",
                        "--max-body-bytes", "65536", log=log) as (base, seen):
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
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "n": 2}' % MODEL.encode(),
     400, "n=1"),
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


def test_disconnect_frees_the_slot_and_the_queue_limit_holds(tmp_path):
    with running_server("--parallel", "1", "--max-queue", "1", log=tmp_path / "s.log") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        long = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8,",
                                         temperature=0, max_tokens=3000, stream=True)
        first = [next(iter(long)) for _ in range(3)]
        assert first
        queued = ThreadPoolExecutor(1).submit(
            lambda: client.completions.create(model=MODEL, prompt="Hello", temperature=0,
                                              max_tokens=4))
        deadline = time.monotonic() + 30
        while metric(base, "strata_queue_length") < 1:  # the second request waits for the slot
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert info.value.response.headers.get("retry-after")
        long.close()  # the client goes away mid-stream
        assert queued.result(timeout=60).choices[0].text is not None
        assert metric(base, 'strata_requests_total{finish_reason="abort"}') == 1
        deadline = time.monotonic() + 10
        while metric(base, "strata_slots_used") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)


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


def test_sigterm_stops_the_server_cleanly(tmp_path):
    import signal

    from server_utils import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and proc.poll() is None
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal: exit status -SIGTERM.
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
