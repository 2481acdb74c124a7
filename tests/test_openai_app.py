"""The OpenAI-compatible API (pipespec.serving.openai_app, served by pipespec.serving.http_server),
driven by the official `openai` client, curl and raw HTTP against two pipelines, each served once for
the module: a random-weight fp32 text chain (tiny -> mid -> target) and the shipped demo models (tiny ->
dream -> target, pictures in `image_url` parts). Every answer equals `LocalPipeline.generate`, the
gRPC `Client` and the target alone, logprobs included (within 1e-5); `n` choices are admitted once;
bad requests are 400s naming the value as the request named it while a stream runs on undisturbed;
a lost drafter makes /health 503 while requests are still answered exactly. The server itself
(binding, health before the stages are linked, a client that leaves, the in-flight limit, a bug):
tests/test_http_server.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipespec import Client, LocalPipeline
from pipespec.cli.demo import demo_config
from pipespec.config import StageSpec
from pipespec.requests.chat import MAX_MESSAGES
from pipespec.stages.causal_lm import CausalLMStage
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from tests.fixtures import DEMO_MODELS
from tests.fixtures.exactness import text_pipeline
from tests.fixtures.faults import kill_stage
from tests.fixtures.openai_http import chat_text, client, events, get, post

CONVERSATION = [
    {"role": "system", "content": "answer in a few words"},
    {"role": "user", "content": "what is the red circle"},
    {"role": "assistant", "content": "a small red circle"},
    {"role": "user", "content": "where is it"},
]
TOKENS = 12
SAMPLING = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}]  # greedy, and seeded sampling


# ---- a random-weight text chain -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(family):
    return {
        name: CausalLMStage(StageSpec(name, "causal_lm", family[name], dtype="float32")) for name in ("tiny", "mid", "target")
    }


@pytest.fixture(scope="module")
def text(family, loaded):
    """The chain tiny -> mid -> target, served on a free port: (pipeline, port)."""
    with text_pipeline(family, loaded, ["tiny", "mid", "target"]) as pipe:
        yield pipe, pipe.serve_http()


@pytest.fixture(scope="module")
def text_alone(family, loaded):
    with text_pipeline(family, loaded, ["target"]) as pipe:
        yield pipe


@pytest.fixture
def admissions(text, monkeypatch) -> list:
    """The arguments the text chain's front door admits, as it admits them."""
    door = text[0].serving.front_door
    admitted, request = [], door.request

    def counted(args):
        admitted.append(args)
        return request(args)

    monkeypatch.setattr(door, "request", counted)
    return admitted


@pytest.mark.parametrize("sampling", SAMPLING)
def test_streamed_deltas_equal_generate_and_the_target_alone(text, text_alone, sampling):
    pipe, port = text
    stream = client(port).chat.completions.create(
        model=pipe.serving.model,
        messages=CONVERSATION,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        **sampling,
    )
    chunks = list(stream)
    want = text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS, **sampling)
    assert chat_text(chunks) == pipe.generate(messages=CONVERSATION, max_new_tokens=TOKENS, **sampling).text == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[-2:-1]] == [want.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(want.token_ids)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert [(p["drafter"], p["verifier"]) for p in last.usage.speculative_decoding] == [("tiny", "mid"), ("mid", "target")]


def test_the_whole_answer_equals_the_streamed_one(text):
    pipe, port = text
    ask = dict(model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, temperature=0.7, seed=3)
    whole = client(port).chat.completions.create(**ask)
    streamed = list(client(port).chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == chat_text(streamed)
    assert whole.choices[0].finish_reason == streamed[-2].choices[0].finish_reason
    assert whole.usage.completion_tokens == streamed[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_equal_the_target_alone_with_seed_plus_i(text, text_alone, admissions, stream):
    pipe, port = text
    answer = client(port).chat.completions.create(
        model=pipe.serving.model,
        messages=CONVERSATION,
        max_tokens=TOKENS,
        temperature=0.9,
        seed=11,
        n=3,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    if stream:
        chunks = list(answer)
        assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2}
        texts = [chat_text(chunks, i) for i in range(3)]
        spent = chunks[-1].usage
    else:
        texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
        spent = answer.usage
    want = [text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS, temperature=0.9, seed=11 + i) for i in range(3)]
    assert texts == [w.text for w in want]
    assert len(set(texts)) > 1, "three seeds gave one answer: the test would not tell them apart"
    assert len(admissions) == 1  # admitted once (rendered, tokenized) for the three choices
    assert spent.completion_tokens == sum(len(w.token_ids) for w in want)  # every choice's tokens
    assert spent.total_tokens == spent.prompt_tokens + spent.completion_tokens  # the prompt counted once
    assert spent.prompt_tokens == len(text_alone.front_door.request(admissions[0])[0].prompt_token_ids)


def test_without_a_seed_each_request_draws_its_own(text, admissions):
    pipe, port = text
    ask = dict(model=pipe.serving.model, messages=CONVERSATION, max_tokens=2, temperature=0.9)
    client(port).chat.completions.create(**ask)
    client(port).chat.completions.create(**ask)
    seeds = [args.seed for args in admissions]
    assert None not in seeds and seeds[0] != seeds[1] and seeds[0] != pipe.config.sampling.seed


def test_the_http_stream_equals_the_grpc_client(text):
    """The same pipeline served over gRPC (pipespec.transport) and HTTP gives the same text."""
    pipe, port = text
    service = CoordinatorService(pipe.serving, "x")
    server, grpc_port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), pipe.loop).result()
    ask = dict(temperature=0.8, seed=5)
    try:
        with Client(f"127.0.0.1:{grpc_port}") as grpc_client:
            want = grpc_client.generate(messages=CONVERSATION, max_new_tokens=TOKENS, **ask).text
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), pipe.loop).result()
    stream = client(port).chat.completions.create(
        model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, stream=True, **ask
    )
    assert chat_text(list(stream)) == want


def test_max_completion_tokens_come_first_and_stop_strings_end_the_answer(text, text_alone):
    pipe, port = text
    openai = client(port)
    short = openai.chat.completions.create(
        model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, max_completion_tokens=5
    )
    want = text_alone.generate(messages=CONVERSATION, max_new_tokens=5)
    assert short.choices[0].message.content == want.text and short.usage.completion_tokens == 5
    whole = text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS).text
    stop = whole[len(whole) // 2 :][:2]
    assert stop.strip(), f"no stop string to cut {whole!r} with"
    cut = text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS, stop=[stop])
    answer = openai.chat.completions.create(model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, stop=[stop])
    assert answer.choices[0].message.content == cut.text and stop not in cut.text
    assert answer.choices[0].finish_reason == cut.finish_reason == "stop"


def test_completions_take_text_without_a_template_and_token_ids(text, text_alone):
    pipe, port = text
    prompt = "the red circle is"
    ids = text_alone.tokenizer.encode(prompt)
    want = text_alone.generate(prompt_token_ids=ids, max_new_tokens=TOKENS)
    openai = client(port)
    by_text = openai.completions.create(model=pipe.serving.model, prompt=prompt, max_tokens=TOKENS)
    by_ids = openai.completions.create(model=pipe.serving.model, prompt=ids, max_tokens=TOKENS)
    streamed = list(openai.completions.create(model=pipe.serving.model, prompt=ids, max_tokens=TOKENS, stream=True))
    assert by_text.choices[0].text == by_ids.choices[0].text == "".join(c.choices[0].text for c in streamed) == want.text
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == len(want.token_ids)


def test_logprobs_are_the_target_alones_in_the_openai_shapes(text, text_alone):
    pipe, port = text
    openai, names = client(port), text_alone.tokenizer
    chat = openai.chat.completions.create(
        model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, logprobs=True, top_logprobs=2
    )
    want = text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(want.logprobs) == len(want.token_ids)
    for entry, token in zip(content, want.logprobs):
        assert entry.token == names.decode([token.token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(token.logprob, abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [names.decode([t]) for t in token.top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(token.top_logprobs, abs=1e-5)
    completion = openai.completions.create(model=pipe.serving.model, prompt=[5, 6, 7], max_tokens=TOKENS, logprobs=2)
    logprobs = completion.choices[0].logprobs
    want = text_alone.generate(prompt_token_ids=[5, 6, 7], max_new_tokens=TOKENS, logprobs=2).logprobs
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == completion.usage.completion_tokens
    assert logprobs.token_logprobs == pytest.approx([t.logprob for t in want], abs=1e-5)
    assert logprobs.top_logprobs == [{names.decode([t]): pytest.approx(lp, abs=1e-5) for t, lp in t.top} for t in want]


def test_bad_values_are_named_as_the_request_names_them(text):
    pipe, port = text
    ask = {"model": pipe.serving.model, "messages": CONVERSATION}
    refused = [  # (the body's extra fields, the field named, what the message says)
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs", "top_logprobs: Input should be less than or equal to 5"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer, got 0"),  # max_new_tokens=0's message
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be a positive integer, got 0"),
        ({"max_tokens": 10**6}, "max_tokens", "max_tokens 1000000 is over limits.max_new_tokens (8192)"),
        (
            {"max_completion_tokens": 10**6},
            "max_completion_tokens",
            "max_completion_tokens 1000000 is over limits.max_new_tokens",
        ),
        ({"max_tokens": 505}, "max_tokens", "+ max_tokens 505 exceeds the context of 512 tokens"),
        ({"temperature": -1}, "temperature", "temperature must be >= 0, got -1"),
        ({"stop": ["x" * 300]}, "stop[0]", "stop[0] of 300 characters is over limits.stop_chars (256)"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)}, "messages", "at most 4096 items"),
    ]
    for extra, param, named in refused:
        status, answer = post(port, "/v1/chat/completions", {**ask, **extra})
        assert status == 400 and answer["error"]["param"] == param and named in answer["error"]["message"], (extra, answer)
    status, answer = post(port, "/v1/completions", {"model": pipe.serving.model, "prompt": [5], "max_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert answer["error"]["message"] == "max_tokens must be a positive integer, got 0"
    status, answer = post(port, "/v1/completions", {"model": pipe.serving.model, "prompt": [], "max_tokens": 2})
    assert status == 400 and answer["error"] == {
        "message": "prompt is empty: at least one token is needed",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }


def test_a_lost_drafter_costs_speed_not_service(family, loaded, text_alone):
    """/health is 503 naming the lost drafter, while requests are still answered as the target alone."""
    with text_pipeline(family, loaded, ["tiny", "target"]) as pipe:
        port = pipe.serve_http()
        kill_stage(pipe, 0)
        status, body = get(port, "/health")
        assert status == 503 and "stage 'tiny' was lost" in json.loads(body)["error"]["message"]
        answer = client(port).chat.completions.create(model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS)
        assert answer.choices[0].message.content == text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS).text


def test_models_health_and_errors_in_the_openai_shape(text):
    pipe, port = text
    assert [m.id for m in client(port).models.list().data] == [pipe.serving.model]
    assert get(port, "/health") == (200, '{"status":"ok"}')
    status, answer = post(port, "/v1/chat/completions", {"model": "gpt-4", "messages": CONVERSATION})
    assert status == 404 and answer["error"]["param"] == "model" and "'gpt-4'" in answer["error"]["message"]
    status, answer = post(port, "/v1/completions", {"model": pipe.serving.model, "prompt": "the", "echo": True})
    assert status == 400 and answer["error"]["message"].startswith("echo is not supported")
    status, answer = post(port, "/v1/chat/completions", {"model": pipe.serving.model, "messages": CONVERSATION, "n": 99})
    assert status == 400 and answer["error"]["param"] == "n"
    status, answer = post(
        port, "/v1/chat/completions", {"model": pipe.serving.model, "messages": CONVERSATION, "temperature": True}
    )
    assert status == 400 and answer["error"]["param"] == "temperature"  # types are strict: no bool taken for a number
    assert get(port, "/openapi.json")[0] == 200
    assert set(answer["error"]) == {"message", "type", "param", "code"}


def test_curl_streams_until_done(text, text_alone):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    pipe, port = text
    body = json.dumps({"model": pipe.serving.model, "messages": CONVERSATION, "max_tokens": TOKENS, "stream": True})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    command = [curl, "-sS", "-N", "-H", "Content-Type: application/json", "-d", body, url]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.endswith("data: [DONE]\n\n")
    chunks = events(out)[:-1]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS).text


# ---- the demo models: pictures --------------------------------------------------------------------

needs_demo = pytest.mark.skipif(not (DEMO_MODELS / "target" / "config.json").is_file(), reason="no demo models")
PICTURE = DEMO_MODELS / "example.png"


def picture_messages(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]
    return [{"role": "user", "content": parts}]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """A directory of media the demo server may read (holding the demo's picture), beside one it may not."""
    root = tmp_path_factory.mktemp("media")
    for where in ("allowed", "elsewhere"):
        (root / where).mkdir()
        shutil.copy(PICTURE, root / where / "picture.png")
    return root


@pytest.fixture(scope="module")
def demo(media):
    """tiny -> dream -> target of models/demo, served with `media/allowed` readable: (pipeline, port)."""
    with LocalPipeline(demo_config(DEMO_MODELS, ["tiny", "dream", "target"], "float32", 1)) as pipe:
        yield pipe, pipe.serve_http(allowed_media=media / "allowed")


@pytest.fixture(scope="module")
def demo_alone(demo):
    with LocalPipeline(demo_config(DEMO_MODELS, ["target"], "float32", 1), stages=[demo[0].stages[-1]]) as pipe:
        yield pipe


@needs_demo
def test_a_picture_as_data_url_or_allowed_file_equals_the_target_alone(demo, demo_alone, media):
    pipe, port = demo
    openai, model = client(port), pipe.serving.model
    messages = picture_messages(data_url(PICTURE.read_bytes()))
    want = demo_alone.generate(messages=messages, max_new_tokens=TOKENS)
    chunks = list(
        openai.chat.completions.create(
            model=model, messages=messages, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chat_text(chunks) == pipe.generate(messages=messages, max_new_tokens=TOKENS).text == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    for url in (data_url(PICTURE.read_bytes()), "picture.png", f"file://{media / 'allowed' / 'picture.png'}"):
        whole = openai.chat.completions.create(model=model, messages=picture_messages(url), max_tokens=TOKENS)
        assert whole.choices[0].message.content == want.text, url


@needs_demo
def test_three_seeded_choices_on_the_demo_each_equal_the_target_alone(demo, demo_alone):
    pipe, port = demo
    messages = picture_messages(data_url(PICTURE.read_bytes()))
    answer = client(port).chat.completions.create(
        model=pipe.serving.model, messages=messages, max_tokens=TOKENS, temperature=1.0, seed=21, n=3
    )
    texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == [
        demo_alone.generate(messages=messages, max_new_tokens=TOKENS, temperature=1.0, seed=21 + i).text for i in range(3)
    ]


@needs_demo
def test_bad_requests_are_400s_naming_the_value_while_a_stream_finishes_exactly(demo, demo_alone, media):
    pipe, port = demo
    model = pipe.serving.model
    messages = picture_messages(data_url(PICTURE.read_bytes()))
    stream = client(port).chat.completions.create(model=model, messages=messages, max_tokens=32, stream=True)
    chunks = [next(stream)]
    while not chat_text(chunks):  # running: its first tokens are here
        chunks.append(next(stream))
    outside = str(media / "elsewhere" / "picture.png")
    bad = [
        ('{"model": "demo", "messages": [', "not valid JSON"),
        ({"model": model, "messages": messages, "logit_bias": {}}, "'logit_bias'"),
        ({"model": model, "messages": messages, "temperature": -1}, "temperature must be >= 0, got -1"),
        ({"model": model, "messages": picture_messages(data_url(b"not a picture"))}, "does not decode as an image"),
        ({"model": model, "messages": picture_messages(outside)}, f"{outside!r} is outside"),
        ({"model": model, "messages": picture_messages("../elsewhere/picture.png")}, "'../elsewhere/picture.png' is outside"),
        ({"model": model, "messages": picture_messages("http://example.com/a.png")}, "http(s) URLs are not fetched"),
        ({"model": model, "messages": [{"role": "user", "content": "red " * 2000}]}, "exceeds the context"),
    ]
    for body, named in bad:
        status, answer = post(port, "/v1/chat/completions", body)
        assert status == 400, answer
        assert named in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    chunks += list(stream)
    assert chat_text(chunks) == demo_alone.generate(messages=messages, max_new_tokens=32).text
