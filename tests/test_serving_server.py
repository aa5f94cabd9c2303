"""The OpenAI-compatible server with the real `openai` client, on 127.0.0.1 (a free port), over a tiny random HF
checkpoint this module writes (its tokenizer's words are w0 .. w96; a chat template in tokenizer_config.json):
completions and chat, streamed and not; 16 concurrent clients each equal to their solo run and to
`models.generate`; a client that disconnects mid-stream frees its row and blocks; bad requests get 4xx JSON while
the server keeps serving; a full queue answers 503; Ctrl-C ends an in-flight stream with an error event. The last
test stops the module's server."""

import concurrent.futures
import dataclasses
import http.client
import json
import os
import signal
import socket
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from hf_checkpoints import write_hf_checkpoint

from jax_neuronmm.models import generate, load_checkpoint
from jax_neuronmm.serving.chat import load_chat_template
from jax_neuronmm.serving.engine import Engine, EngineOptions
from jax_neuronmm.serving.server import Server, Service, create_app

TEMPLATE = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
OPTIONS = EngineOptions(max_batch=16, block_size=4, prefill_buckets=(8, 32), batch_buckets=(16,))
WAIT_S = 60  # bound on every wait for the server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("serve") / "tiny-llama")
    write_hf_checkpoint(np.random.default_rng(54), path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "bos_token": "w0", "eos_token": "w5"}, f)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    model = load_checkpoint(checkpoint)
    service = Service(Engine(model, OPTIONS), "tiny-llama", load_chat_template(checkpoint))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    server = Server(config, service.engine)
    service.engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    server.port, server.base = port, f"http://127.0.0.1:{port}"
    server.service, server.thread, server.model = service, thread, model
    yield server
    server.should_exit = True
    thread.join(WAIT_S)
    service.engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def _words(ids):
    return [f"w{i}" for i in ids]


def _post(server, path, content: str):
    """(status, parsed JSON body) of a raw POST (what a client with a bug might send)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        connection.request("POST", path, body=content.encode(), headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _complete(client, prompt, n, stream=False):
    """(text, finish_reason) of a greedy completion of n tokens (end-of-sequence ignored)."""
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        response = client.completions.create(**kwargs)
        assert response.usage.completion_tokens == n
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = list(client.completions.create(stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def test_models_and_health(server, client):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    connection.request("GET", "/health")
    assert json.loads(connection.getresponse().read()) == {"status": "ok"}
    connection.close()
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def test_completions_streamed_and_not_equal_generate(server, client):
    prompt = "w11 w42 w8 w60"
    text, reason = _complete(client, prompt, 10)
    assert reason == "length"
    assert _complete(client, prompt, 10, stream=True) == (text, reason)
    ids = [int(w[1:]) for w in prompt.split()]
    want = np.asarray(generate(server.model, np.asarray([ids]), 10))[0, 4:]
    assert text.split() == _words(want)


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w20 w21 w22"}]
    kwargs = dict(model="tiny-llama", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    response = client.chat.completions.create(**kwargs)
    content = response.choices[0].message.content
    assert response.choices[0].message.role == "assistant" and response.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    # The template's rendering, sent as a completion, continues the same way.
    rendered = "w1 w9 w10 w2 w1 w20 w21 w22 w2 w3"
    assert response.usage.prompt_tokens == len(rendered.split())
    assert _complete(client, rendered, 6)[0] == content


def test_sixteen_concurrent_clients_equal_their_solo_runs(client, rng):
    prompts = [" ".join(_words(rng.integers(8, 97, size=rng.integers(1, 20)))) for _ in range(16)]
    counts = [int(n) for n in rng.integers(3, 12, size=16)]
    solo = [_complete(client, p, n) for p, n in zip(prompts, counts)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(_complete, client, p, n, i % 2 == 1) for i, (p, n) in enumerate(zip(prompts, counts))]
        together = [f.result(timeout=WAIT_S * 2) for f in futures]
    assert together == solo


def _wait_idle(engine):
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["free_blocks"] == engine.num_blocks:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_row_and_blocks(server, client, monkeypatch):
    engine = server.service.engine
    step = engine._step

    def slow_step(*args):  # the tiny model would otherwise finish all 60 tokens before the client hangs up
        time.sleep(0.05)
        return step(*args)

    monkeypatch.setattr(engine, "_step", slow_step)
    aborted = engine.stats()["aborted"]
    stream = client.completions.create(
        model="tiny-llama", prompt="w30 w31", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()  # one chunk, then hang up
    deadline = time.monotonic() + WAIT_S
    while engine.stats()["aborted"] == aborted:  # cancelled, not run to its end
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    assert _wait_idle(engine)["aborted"] == aborted + 1
    assert _complete(client, "w30 w31", 3)[1] == "length"


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", "{not json", 400),
        ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "w1", "max_tokens": 0}, 400),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "w1", "max_tokens": 64}, 400),
        ("/v1/completions", {"model": "tiny-llama", "prompt": " ".join(["w9"] * 70)}, 400),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "w1", "temperature": "hot"}, 400),
        ("/v1/completions", {"model": "tiny-llama", "prompt": {"text": "w1"}}, 400),
        ("/v1/completions", {"model": "tiny-llama", "prompt": [1, 500]}, 400),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "robot", "content": "w1"}]}, 400),
        ("/v1/nowhere", {}, 404),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, path, body, status):
    content = body if isinstance(body, str) else json.dumps(body)
    got, reply = _post(server, path, content)
    assert got == status, reply
    error = reply["error"]
    assert error["message"] and error["type"]
    assert _complete(client, "w2 w3", 2)[1] == "length"


def test_full_queue_answers_503(server, client):
    engine = server.service.engine
    options = engine.options
    engine.options = dataclasses.replace(options, max_waiting=0)  # no room in the queue at all
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model="tiny-llama", prompt="w1", max_tokens=2)
        assert raised.value.status_code == 503 and raised.value.body["type"] == "server_overloaded"
    finally:
        engine.options = options
    assert _complete(client, "w2 w3", 2)[1] == "length"


def test_ctrl_c_ends_in_flight_streams_with_an_error_and_stops(server, client):
    """Stops the module's server: keep it last."""
    stream = client.completions.create(
        model="tiny-llama", prompt="w40", max_tokens=60, stream=True, temperature=0, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    server.handle_exit(signal.SIGINT, None)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            pass
    server.thread.join(WAIT_S)
    assert not server.thread.is_alive()
