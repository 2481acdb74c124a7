"""The OpenAI-compatible API (pipespec.serving.openai_app, served by pipespec.serving.http_server),
driven by the official `openai` client, curl and raw HTTP against two pipelines, each served once for
the module: a random-weight fp32 text chain (tiny -> mid -> target) and the shipped demo models (tiny ->
dream -> target, pictures in `image_url` parts). Every answer equals `LocalPipeline.generate` and the
target alone; bad requests are 400s naming the value while a stream runs on undisturbed. The server
itself (binding, health before the stages are linked, a client that leaves): tests/test_http_server.py.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipespec import LocalPipeline
from pipespec.cluster.demo import DEMO_MODELS, demo_config
from pipespec.stages.causal_lm import CausalLMStage
from tests.fixtures.exactness import text_pipeline
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
    return {name: CausalLMStage(name, family[name], "float32") for name in ("tiny", "mid", "target")}


@pytest.fixture(scope="module")
def text(family, loaded):
    """The chain tiny -> mid -> target, served on a free port: (pipeline, port)."""
    with text_pipeline(family, loaded, ["tiny", "mid", "target"]) as pipe:
        yield pipe, pipe.serve_http()


@pytest.fixture(scope="module")
def text_alone(family, loaded):
    with text_pipeline(family, loaded, ["target"]) as pipe:
        yield pipe


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
def test_n_choices_each_equal_the_target_alone_with_seed_plus_i(text, text_alone, stream):
    pipe, port = text
    answer = client(port).chat.completions.create(
        model=pipe.serving.model, messages=CONVERSATION, max_tokens=TOKENS, temperature=0.9, seed=11, n=3, stream=stream
    )
    if stream:
        chunks = list(answer)
        assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2}
        texts = [chat_text(chunks, i) for i in range(3)]
    else:
        texts = [c.message.content for c in sorted(answer.choices, key=lambda c: c.index)]
    want = [
        text_alone.generate(messages=CONVERSATION, max_new_tokens=TOKENS, temperature=0.9, seed=11 + i).text for i in range(3)
    ]
    assert texts == want
    assert len(set(want)) > 1, "three seeds gave one answer: the test would not tell them apart"


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


def test_logprobs_come_in_the_openai_shapes(text):
    pipe, port = text
    openai = client(port)
    chat = openai.chat.completions.create(
        model=pipe.serving.model, messages=CONVERSATION, max_tokens=4, logprobs=True, top_logprobs=2
    )
    for entry in chat.choices[0].logprobs.content:  # as many as the target sent (pipespec.logprobs)
        assert isinstance(entry.token, str) and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
    completion = openai.completions.create(model=pipe.serving.model, prompt=[5, 6, 7], max_tokens=4, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset)
    status, answer = post(
        port, "/v1/chat/completions", {"model": pipe.serving.model, "messages": CONVERSATION, "top_logprobs": 2}
    )
    assert status == 400 and "top_logprobs needs logprobs" in answer["error"]["message"]
    status, answer = post(
        port,
        "/v1/chat/completions",
        {"model": pipe.serving.model, "messages": CONVERSATION, "logprobs": True, "top_logprobs": 6},
    )
    assert status == 400 and "logprobs must be in [0, 5]" in answer["error"]["message"]


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
