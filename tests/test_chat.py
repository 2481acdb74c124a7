"""Tests for pipespec/requests/chat.py: a conversation (system, user and assistant turns) as every way in takes it.

- Bad messages are refused naming the message or part (`conversation`, `check`, and through
  `GenerateArgs` the image's place).
- A system + user + assistant + user conversation renders through a text tokenizer's chat template
  (the toy family's tokenizer, given one) and through the demo target's processor (models/demo/target,
  with an image) to the ids the template gives, drafters get the text-only view (no image), and a
  pipeline's answer on it equals the target alone.
- The messages cross the gRPC wire (pipespec/transport/generate_request.py) unchanged, and a `Client`
  sending them gets the in-process answer.
- The demo's chat template gives a system message its own "SYSTEM: " prefix, renders user and assistant
  turns as the shipped models were trained on them, and puts a message's image after its text.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from PIL import Image

from demo.llava_template import CHAT_TEMPLATE
from pipespec import Client, LocalPipeline, load_config
from pipespec.protos import pipespec_pb2 as pb
from pipespec.requests.chat import IMAGE, ChatMessage, Part, check, conversation
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.images import image_bytes, load_processor
from pipespec.requests.tokenization import encode_prompt
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from pipespec.transport.generate_request import from_proto, to_proto
from tests.fixtures import DEMO_MODELS as DEMO

TOKENS = 16

# system + user (with the image's place) + assistant + user, as a user gives it (OpenAI-shaped)
CHAT = [
    {"role": "system", "content": "Answer in a few words."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the picture"}]},
    {"role": "assistant", "content": "a red circle"},
    {"role": "user", "content": [{"type": "text", "text": "and where is it"}]},
]
TEXT_CHAT = [
    CHAT[0],
    {"role": "user", "content": "what is in the picture"},
    CHAT[2],
    {"role": "user", "content": "and where is it"},
]

# the demo's template without its system prefix and string content (each message's text, then its image)
OLD_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% endif %}{% endfor %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
# a text model's template: each message's content is one string
TEXT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def picture() -> Image.Image:
    with Image.open(DEMO / "example.png") as image:
        return image.convert("RGB")


# ---- bad messages ------------------------------------------------------------------------------

USER = {"role": "user", "content": "hello"}
REFUSED = {
    "not a list": ("hello", "messages must be a list of messages, got 'hello'"),
    "empty": ([], "messages is empty: give at least one message"),
    "a message not a mapping": ([USER, "hi"], "messages[1] must be a mapping with role and content, got 'hi'"),
    "unknown role": (
        [USER, {"role": "robot", "content": "hi"}],
        "messages[1].role must be one of system, user, assistant, got 'robot'",
    ),
    "unknown field": (
        [USER, {"role": "user", "content": "hi", "name": "x"}],
        "messages[1] has unknown field 'name' (a message has role and content)",
    ),
    "content neither text nor parts": (
        [USER, {"role": "user", "content": []}],
        "messages[1].content must be a string or a non-empty list of parts, got []",
    ),
    "unknown part type": (
        [USER, {"role": "user", "content": [{"type": "audio"}]}],
        "messages[1].content[0].type must be text, image or image_url, got 'audio'",
    ),
    "unknown part field": (
        [USER, {"role": "user", "content": [{"type": "text", "text": "hi", "bold": True}]}],
        "messages[1].content[0] has unknown field 'bold'",
    ),
    "text part without text": (
        [USER, {"role": "user", "content": [{"type": "text"}]}],
        "messages[1].content[0].text must be a string, got None",
    ),
    "image_url without a url": (
        [USER, {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}],
        r"messages[1].content[1].image_url.url must be a string (a data URL or a file path), got None",
    ),
    "two images": (
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": b"a"}, {"type": "image", "image": b"b"}, {"type": "text", "text": "x"}],
            }
        ],
        "messages carry 2 images; a request takes at most one",
    ),
    "two image places": (
        [USER, {"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
        "messages carry 2 image parts; a request takes at most one image",
    ),
    "no text at all": ([{"role": "user", "content": " "}], "the messages hold no text: give some"),
}


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED)
def test_bad_messages_are_refused_naming_them(case):
    messages, why = REFUSED[case]
    with pytest.raises(ValueError) as refused:
        check(conversation(messages)[0])
    assert str(refused.value) == why
    with pytest.raises(ValueError) as refused_too:
        GenerateArgs(messages=messages)  # what every way in builds
    assert str(refused_too.value) == why


def test_an_image_needs_its_place_and_a_place_its_image():
    place = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    with pytest.raises(ValueError, match=r"the messages have an image part but no image is given \(image=, or the part's"):
        GenerateArgs(messages=place)
    with pytest.raises(ValueError, match=r'an image needs its place in the messages: a \{"type": "image"\} part'):
        GenerateArgs(messages=[USER], image=b"png")
    carried = [{"role": "user", "content": [{"type": "image", "image": b"png"}, {"type": "text", "text": "what is it"}]}]
    with pytest.raises(ValueError, match="the image is given twice: in a message part and as image="):
        GenerateArgs(messages=carried, image=b"png")
    with pytest.raises(ValueError, match=r"messages\[0\].role must be one of"):
        check((ChatMessage("tool", (Part("hi"),)),))


def test_messages_are_kept_as_chat_messages_and_the_image_moves_to_image():
    args = GenerateArgs(
        messages=[*CHAT[:1], {"role": "user", "content": [{"type": "image", "image": b"png"}, {"type": "text", "text": "hi"}]}]
    )
    assert args.messages == (
        ChatMessage("system", (Part("Answer in a few words."),)),
        ChatMessage("user", (IMAGE, Part("hi"))),
    )
    assert args.image == b"png"


# ---- rendering through chat templates ------------------------------------------------------------


@pytest.fixture(scope="module")
def text_family(family, tmp_path_factory) -> dict[str, str]:
    """The toy family's target and tiny drafter, their tokenizer given TEXT_TEMPLATE."""
    root = tmp_path_factory.mktemp("chat-family")
    out = {}
    for name in ("tiny", "target"):
        out[name] = str(shutil.copytree(family[name], root / name))
        (root / name / "chat_template.jinja").write_text(TEXT_TEMPLATE)
    return out


def text_config(paths: dict[str, str], names: list[str]):
    stages = [{"name": n, "kind": "causal_lm", "model": paths[n], "dtype": "float32", "max_lookahead": 4} for n in names]
    return load_config({"stages": stages})


def test_a_conversation_renders_through_a_text_tokenizers_template(text_family):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_family["target"])
    rendered = "".join(
        [
            "<s>system\nAnswer in a few words.</s>\n",
            "<s>user\nwhat is in the picture</s>\n",
            "<s>assistant\na red circle</s>\n",
            "<s>user\nand where is it</s>\n",
            "<s>assistant\n",
        ]
    )
    assert tokenizer.apply_chat_template(TEXT_CHAT, add_generation_prompt=True, tokenize=False) == rendered
    want = tokenizer.apply_chat_template(TEXT_CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(want) == tokenizer.encode(rendered, add_special_tokens=False)
    messages = GenerateArgs(messages=TEXT_CHAT).conversation()
    assert encode_prompt(tokenizer, messages) == list(want)
    with LocalPipeline(text_config(text_family, ["target"])) as alone:
        spec, _ = alone.request(messages=TEXT_CHAT)
        assert list(spec.prompt_token_ids) == list(want)
        expected = alone.generate(prompt_token_ids=want, max_new_tokens=TOKENS).token_ids
        assert alone.generate(messages=TEXT_CHAT, max_new_tokens=TOKENS).token_ids == expected
    with LocalPipeline(text_config(text_family, ["tiny", "target"])) as pipe:
        assert pipe.generate(messages=TEXT_CHAT, max_new_tokens=TOKENS).token_ids == expected


def demo_config(names: list[str]):
    kinds = {"tiny": "causal_lm", "target": "vlm"}
    stages = [{"name": n, "kind": kinds[n], "model": str(DEMO / n), "dtype": "float32", "max_lookahead": 4} for n in names]
    return load_config({"stages": stages})


@pytest.fixture(scope="module")
def demo_alone():
    with LocalPipeline(demo_config(["target"])) as alone:
        yield alone


def test_a_conversation_with_an_image_renders_through_the_demo_targets_processor(demo_alone):
    processor = load_processor(str(DEMO / "target"), "target")
    image = picture()
    with_image = [
        {
            "role": m["role"],
            "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"],
        }
        for m in CHAT
    ]
    with_image[1]["content"] = [{"type": "image", "image": image}, with_image[1]["content"][1]]
    text = (
        "SYSTEM: Answer in a few words.USER: what is in the picture<image>ASSISTANT: a red circleUSER: and where is itASSISTANT:"
    )
    assert processor.apply_chat_template(with_image, add_generation_prompt=True, tokenize=False) == text

    def ids(messages: list[dict]) -> list[int]:
        out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return out["input_ids"][0]  # a batch of one

    without_image = [{**m, "content": [p for p in m["content"] if p["type"] != "image"]} for m in with_image]
    spec, _ = demo_alone.request(messages=CHAT, image=image)
    assert list(spec.prompt_token_ids) == ids(with_image)  # the image's placeholder expanded to its tokens
    assert list(spec.text_prompt_token_ids) == ids(without_image)  # what text drafters see: no image
    assert processor.tokenizer.convert_tokens_to_ids("<image>") not in spec.text_prompt_token_ids


def test_a_pipeline_answers_a_conversation_with_an_image_as_the_target_alone(demo_alone):
    image = picture()
    expected = demo_alone.generate(messages=CHAT, image=image, max_new_tokens=TOKENS)
    assert expected.finish_reason in ("length", "stop") and expected.token_ids
    carried = [CHAT[0], {"role": "user", "content": [{"type": "image", "image": image}, CHAT[1]["content"][1]]}, *CHAT[2:]]
    assert demo_alone.generate(messages=carried, max_new_tokens=TOKENS).token_ids == expected.token_ids  # the image in its part
    with LocalPipeline(demo_config(["tiny", "target"])) as pipe:
        assert pipe.generate(messages=CHAT, image=image, max_new_tokens=TOKENS).token_ids == expected.token_ids


# ---- across the wire -----------------------------------------------------------------------------


def test_messages_cross_the_wire_unchanged():
    messages = [
        {"role": "system", "content": "Réponds en deux mots. 🙂"},
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "image"}, {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": "a red circle"},
        {"role": "user", "content": [{"type": "text", "text": "where"}, {"type": "text", "text": " is it?"}]},
    ]
    args = GenerateArgs(messages=messages, image=b"\x89PNG bytes", max_new_tokens=9)
    wire = to_proto(args).SerializeToString()
    assert from_proto(pb.GenerateRequest.FromString(wire)) == args
    assert from_proto(pb.GenerateRequest.FromString(wire)).messages[1].parts == (Part(""), IMAGE, Part("what is it"))


def test_a_client_sending_messages_gets_the_in_process_answer(demo_alone, tmp_path):
    image = picture()
    path = tmp_path / "picture.png"
    path.write_bytes(image_bytes(image)[0])
    expected = demo_alone.generate(messages=CHAT, image=image, max_new_tokens=TOKENS).token_ids
    service = CoordinatorService(demo_alone.serving, "chat")
    server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), demo_alone.loop).result()
    try:
        with Client(f"127.0.0.1:{port}") as client:
            assert client.generate(messages=CHAT, image=str(path), max_new_tokens=TOKENS).token_ids == expected
            in_part = [
                CHAT[0],
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}}, CHAT[1]["content"][1]]},
                *CHAT[2:],
            ]
            assert client.generate(messages=in_part, max_new_tokens=TOKENS).token_ids == expected
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), demo_alone.loop).result()


def test_the_command_line_sends_a_system_message_before_the_prompt(demo_alone, tmp_path, capsys):
    from pipespec.cli import _printable
    from pipespec.cli import main as cli

    path = tmp_path / "picture.png"
    path.write_bytes(image_bytes(picture())[0])
    messages = [CHAT[0], CHAT[1]]
    expected = demo_alone.generate(messages=messages, image=picture(), max_new_tokens=TOKENS).text
    service = CoordinatorService(demo_alone.serving, "chat")
    server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), demo_alone.loop).result()
    try:
        prompt = ["--prompt", CHAT[1]["content"][1]["text"], "--image", str(path), "--max-new-tokens", str(TOKENS)]
        assert cli(["generate", "--address", f"127.0.0.1:{port}", "--system", CHAT[0]["content"], *prompt]) == 0
        assert capsys.readouterr().out == _printable(expected) + "\n"
        assert cli(["generate", "--address", f"127.0.0.1:{port}", *prompt, "--logprobs", "2"]) == 0
        alone = demo_alone.generate(CHAT[1]["content"][1]["text"], image=picture(), max_new_tokens=TOKENS, logprobs=2)
        printed = capsys.readouterr()
        assert printed.out == _printable(alone.text) + "\n"
        header, *rows = printed.err.splitlines()[:-1]  # after the answer, before the summary line
        assert header == "token\tlogprob\ttop" and len(rows) == len(alone.token_ids) == len(alone.logprobs)
        for row, want in zip(rows, alone.logprobs):
            token, logprob, top = row.split("\t")
            tops = [(int(i), float(p)) for i, p in (pair.split(":") for pair in top.split(" "))]
            assert int(token) == want.token and float(logprob) == pytest.approx(want.logprob, abs=1e-5)
            assert [i for i, _ in tops] == list(want.top_ids)
            assert [p for _, p in tops] == pytest.approx(want.top_logprobs, abs=1e-5)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), demo_alone.loop).result()


# ---- the demo's chat template ----------------------------------------------------------------------

TURNS = {
    "one user turn": [{"role": "user", "content": [{"type": "text", "text": "what is it"}]}],
    "with an image": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}],
    "several turns": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a red circle"}]},
        {"role": "user", "content": [{"type": "text", "text": "and where"}]},
    ],
}


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO / "tokenizer")


def test_the_shipped_models_carry_the_demos_template():
    for path in sorted(DEMO.glob("*/chat_template.jinja")):
        assert path.read_text() == CHAT_TEMPLATE, path


@pytest.mark.parametrize("turns", TURNS, ids=TURNS)
@pytest.mark.parametrize("prompt", [True, False], ids=["generation prompt", "no generation prompt"])
def test_user_and_assistant_turns_render_as_the_models_were_trained(demo_tokenizer, turns, prompt):
    def render(template: str) -> str:
        return demo_tokenizer.apply_chat_template(
            TURNS[turns], chat_template=template, add_generation_prompt=prompt, tokenize=False
        )

    assert render(CHAT_TEMPLATE) == render(OLD_TEMPLATE)


def test_the_image_goes_after_the_messages_text_wherever_its_part_stands(demo_tokenizer):
    def render(parts: list[dict]) -> str:
        messages = [{"role": "user", "content": parts}]
        return demo_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    first, last = TURNS["with an image"][0]["content"], TURNS["with an image"][0]["content"][::-1]
    assert render(first) == render(last) == "USER: what is it<image>ASSISTANT:"


def test_a_system_message_has_its_own_prefix_and_a_string_reads_as_one_text_part(demo_tokenizer):
    def render(messages: list[dict]) -> str:
        return demo_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert render([system, *TURNS["one user turn"]]) == "SYSTEM: Be brief.USER: what is itASSISTANT:"
    assert render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is it"}]) == render(
        [system, *TURNS["one user turn"]]
    )
