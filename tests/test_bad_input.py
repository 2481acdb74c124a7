"""Bad input (issue 19's table, every row) is refused the same way on every way in, within bounded memory.

ONE table, `ROWS`: each bad request goes through (a) `LocalPipeline` (its front door, in process),
(b) a `Client` against the coordinator's gRPC service, and the same request sent raw where the wire
can carry it (no client-side check: the server refuses it itself), (c) `pipespec generate`
(`pipespec.cli.main`, in process: exit 2, nothing on stdout) where its flags can say it. Each is refused with the same message,
naming the value or the limit, while a good request started before it finishes equal to the target
alone. Then: this process serves the front door, and its memory after rounds of the image rows
(six at once too) is back within 100 MB of where it started; a 9000x9000 PNG of 236 KB is refused
from its header, never decoded.

The pipeline: a small random LLaVA target behind a 1-layer text drafter (tests/fixtures/vlm_zoo),
linked by gRPC on 127.0.0.1, its coordinator served by `CoordinatorService` on 127.0.0.1 (port 0),
with small limits. Per-client limits, request ids, `Cancel` and `Health`: tests/test_coordinator_service.py.
"""

from __future__ import annotations

import asyncio
import io
import math
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from PIL import Image

from pipespec import Client, GenerationError, LocalPipeline, load_config
from pipespec.cli import main as cli
from pipespec.protos import pipespec_pb2 as pb
from pipespec.protos import pipespec_pb2_grpc as pb_grpc
from pipespec.transport.coordinator_service import CoordinatorService, serve_coordinator
from tests.fixtures.vlm_zoo import build_zoo_family

LIMITS = {"image_bytes": 2**20, "prompt_tokens": 256, "max_new_tokens": 128, "stop_strings": 4, "stop_chars": 16}


def png(width: int, height: int, rows: int | None = None) -> bytes:
    """A black RGB PNG, compressed row by row (never held decoded); only its first `rows` rows if given (truncated)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z, row = zlib.compressobj(9), bytes(1 + 3 * width)
    body = b"".join(z.compress(row) for _ in range(height if rows is None else rows)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def picture() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((40, 50, 3)) * 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


BOMB = png(9000, 9000)  # 236 KB; 243 MB decoded (RGB), more through the processor
GIANT = png(20000, 20000, rows=4)  # over PIL's own bound: refused by PIL from the header
PROMPT = "what is the red circle"
GOOD = dict(prompt=PROMPT, image=picture(), max_new_tokens=24)


@dataclass(frozen=True)
class Row:
    id: str
    kwargs: dict[str, Any]  # to LocalPipeline.generate and Client.stream
    names: str  # a regex the message must match: the value or the limit


# fmt: off
ROWS = [
    # the prompt
    Row("no prompt", {}, r"^no prompt: give prompt, messages or prompt_token_ids$"),
    Row("prompt and ids", dict(prompt="hi", prompt_token_ids=[1]), r"exactly one of prompt, messages and prompt_token_ids, not prompt and prompt_token_ids"),
    Row("empty ids", dict(prompt_token_ids=[]), r"prompt_token_ids is empty"),
    Row("empty prompt", dict(prompt=""), r"the prompt is empty"),
    Row("blank prompt", dict(prompt=" \n\t"), r"the prompt is empty"),
    Row("prompt not text", dict(prompt=7), r"prompt must be a string, got 7"),
    Row("token id a float", dict(prompt_token_ids=[1, 2.5]), r"prompt_token_ids\[1\] must be a token id .*got 2\.5"),
    Row("token id negative", dict(prompt_token_ids=[-1]), r"prompt_token_ids\[0\] must be a token id .*got -1"),
    Row("token id past the vocabulary", dict(prompt_token_ids=[1, 10**6]), r"\[1000000\] are outside the vocabulary"),
    Row("token id beyond int64", dict(prompt_token_ids=[2**70]), r"prompt_token_ids\[0\] must be a token id"),
    Row("prompt ids over the limit", dict(prompt_token_ids=[1] * 257), r"prompt of 257 tokens is over limits\.prompt_tokens \(256\)"),
    Row("prompt text over the limit", dict(prompt="the red circle " * 100), r"prompt of \d+ tokens is over limits\.prompt_tokens \(256\)"),
    Row("prompt text far over", dict(prompt="x" * 4097), r"prompt of 4097 characters is over limits\.prompt_tokens \(256\)"),
    # max_new_tokens
    Row("max_new_tokens 0", dict(prompt=PROMPT, max_new_tokens=0), r"max_new_tokens must be a positive integer, got 0$"),
    Row("max_new_tokens negative", dict(prompt=PROMPT, max_new_tokens=-5), r"max_new_tokens must be a positive integer, got -5"),
    Row("max_new_tokens over the limit", dict(prompt=PROMPT, max_new_tokens=129), r"max_new_tokens 129 is over limits\.max_new_tokens \(128\)"),
    Row("max_new_tokens beyond int32", dict(prompt=PROMPT, max_new_tokens=2**40), r"max_new_tokens 1099511627776 is over limits\.max_new_tokens"),
    Row("max_new_tokens beyond int64", dict(prompt=PROMPT, max_new_tokens=2**70), r"max_new_tokens must be a positive integer below 2\*\*63"),
    Row("max_new_tokens a string", dict(prompt=PROMPT, max_new_tokens="64"), r"max_new_tokens must be a positive integer, got '64'"),
    Row("max_new_tokens a bool", dict(prompt=PROMPT, max_new_tokens=True), r"max_new_tokens must be a positive integer, got True"),
    # sampling
    Row("temperature inf", dict(prompt=PROMPT, temperature=math.inf), r"temperature must be finite, got inf"),
    Row("temperature nan", dict(prompt=PROMPT, temperature=math.nan), r"temperature must be finite, got nan"),
    Row("temperature negative", dict(prompt=PROMPT, temperature=-2.0), r"temperature must be >= 0, got -2\.0"),
    Row("temperature a string", dict(prompt=PROMPT, temperature="hot"), r"temperature must be a number, got 'hot'"),
    Row("top_p above 1", dict(prompt=PROMPT, top_p=1.5), r"top_p must be in \(0, 1\], got 1\.5"),
    Row("top_p 0", dict(prompt=PROMPT, top_p=0.0), r"top_p must be in \(0, 1\], got 0\.0"),
    Row("top_k negative", dict(prompt=PROMPT, top_k=-1), r"top_k must be >= 0, got -1"),
    Row("top_k a float", dict(prompt=PROMPT, top_k=2.5), r"top_k must be an integer, got 2\.5"),
    Row("top_k a bool", dict(prompt=PROMPT, top_k=False), r"top_k must be an integer, got False"),
    Row("seed -1", dict(prompt=PROMPT, seed=-1), r"seed must be in \[0, 2\*\*64\), got -1"),
    Row("seed beyond 64 bits", dict(prompt=PROMPT, seed=2**70), r"seed must be in \[0, 2\*\*64\), got 1180591620717411303424"),
    Row("seed a string", dict(prompt=PROMPT, seed="7"), r"seed must be an integer, got '7'"),
    # stop strings
    Row("empty stop string", dict(prompt=PROMPT, stop=[""]), r"stop\[0\] is empty"),
    Row("stop not a string", dict(prompt=PROMPT, stop=[5]), r"stop\[0\] must be a string, got 5"),
    Row("too many stop strings", dict(prompt=PROMPT, stop=list("abcde")), r"5 stop strings are over limits\.stop_strings \(4\)"),
    Row("stop string too long", dict(prompt=PROMPT, stop=["x" * 17]), r"stop\[0\] of 17 characters is over limits\.stop_chars \(16\)"),
    # images
    Row("image over the byte limit", dict(prompt=PROMPT, image=bytes(2**20 + 1)), r"image of 1048577 bytes is over limits\.image_bytes \(1048576\)"),
    Row("image of 9000x9000 pixels", dict(prompt=PROMPT, image=BOMB), r"is 9000x9000 = 81000000 pixels, over limits\.image_pixels \(25000000\)"),
    Row("image of 20000x20000 pixels", dict(prompt=PROMPT, image=GIANT), r"too large to decode .*400000000 pixels.*limits\.image_pixels is 25000000"),
    Row("image not an image", dict(prompt=PROMPT, image=b"junk"), r"image of 4 bytes does not decode as an image"),
    Row("image truncated", dict(prompt=PROMPT, image=picture()[:3000]), r"image of 3000 bytes does not decode as an image: .*truncated"),
    Row("image with token ids", dict(prompt_token_ids=[1, 2], image=picture()), r"an image needs a text prompt"),
]
# fmt: on
IMAGE_ROWS = [row for row in ROWS if "image" in row.kwargs]


def cli_args(kwargs: dict[str, Any], tmp_path: Path) -> list[str] | None:
    """`pipespec generate`'s flags for `kwargs`, or None where its flags cannot say them."""
    flags = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}
    if not isinstance(kwargs.get("prompt"), str) or not set(kwargs) <= {"prompt", "image", "stop", *flags}:
        return None
    args = ["--prompt", kwargs["prompt"]]
    for name, kind in flags.items():
        if name in kwargs:
            if type(kwargs[name]) is not kind:
                return None
            args += [f"--{name.replace('_', '-')}", str(kwargs[name])]
    for stop in kwargs.get("stop", ()):
        if not isinstance(stop, str):
            return None
        args += ["--stop", stop]
    if "image" in kwargs:
        path = tmp_path / "image.png"
        path.write_bytes(kwargs["image"])
        args += ["--image", str(path)]
    return args


def wire(kwargs: dict[str, Any]) -> pb.GenerateRequest | None:
    """`kwargs` as a raw `GenerateRequest`, unchecked, as another client may send them; None where the
    wire cannot carry them (test_generate_request): only a client can be given those."""
    request = pb.GenerateRequest()
    try:
        for name, value in kwargs.items():
            if name == "prompt_token_ids":
                request.prompt_token_ids.SetInParent()  # given, even when empty
                request.prompt_token_ids.ids.extend(value)
            elif name == "stop":
                request.stop.extend(value)
            else:
                setattr(request, name, value)
    except (TypeError, ValueError):
        return None
    return request


@dataclass
class Door:
    pipe: LocalPipeline
    address: str
    expected: list[int]  # GOOD's tokens from the target alone


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    paths = build_zoo_family("llava", tmp_path_factory.mktemp("zoo"))

    def config(names):
        kinds = {"tiny": "causal_lm", "target": "vlm"}
        stages = [{"name": n, "kind": kinds[n], "model": str(paths[n]), "dtype": "float32", "max_lookahead": 4} for n in names]
        return load_config({"name": "bad-input", "stages": stages, "limits": LIMITS})

    with LocalPipeline(config(["target"])) as alone:
        expected = alone.generate(**GOOD).token_ids
    with LocalPipeline(config(["tiny", "target"]), over_grpc=True) as pipe:
        service = CoordinatorService(pipe.serving, "bad-input")
        server, port = asyncio.run_coroutine_threadsafe(serve_coordinator(service, "127.0.0.1", 0), pipe.loop).result()
        try:
            yield Door(pipe, f"127.0.0.1:{port}", expected)
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), pipe.loop).result()


def refused_locally(door: Door, kwargs: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as refused:
        door.pipe.generate(**kwargs)
    return str(refused.value)


def refused_by_client(door: Door, kwargs: dict[str, Any]) -> str:
    deltas = []
    with Client(door.address) as client, pytest.raises(GenerationError) as refused:
        deltas.extend(client.stream(**kwargs))
    assert deltas == []
    return str(refused.value)


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_is_refused_the_same_way_everywhere(door, row, tmp_path, capsys):
    good = door.pipe.submit(**GOOD)
    message = refused_locally(door, row.kwargs)
    assert re.search(row.names, message), message
    assert "\n" not in message
    assert refused_by_client(door, row.kwargs) == message
    raw = wire(row.kwargs)
    if raw is not None:
        with grpc.insecure_channel(door.address) as channel:
            responses = list(pb_grpc.CoordinatorStub(channel).Generate(raw, timeout=60))
        assert [r.WhichOneof("kind") for r in responses] == ["error"] and responses[0].error.message == message
    args = cli_args(row.kwargs, tmp_path)
    if args is not None:
        assert cli(["generate", "--address", door.address, *args]) == 2  # bad input, whichever side sees it
        printed = capsys.readouterr()
        assert printed.err == f"pipespec generate: {message}\n" and printed.out == ""
    assert good.result(timeout=120).token_ids == door.expected


def test_a_good_request_passes_every_way_in(door, tmp_path, capsys):
    """The table's control: the same pipeline serves GOOD on each way in, equal to the target alone."""
    assert door.pipe.generate(**GOOD).token_ids == door.expected
    assert Client(door.address).generate(**GOOD).token_ids == door.expected
    assert cli(["generate", "--address", door.address, *cli_args(GOOD, tmp_path)]) == 0
    assert "[length; 24 tokens" in capsys.readouterr().err


def test_a_request_larger_than_the_limits_allow_is_not_read(door):
    """gRPC refuses a request over `request_bytes(limits)` before it is read (the issue's 500 MiB image
    field, here 8 MiB), naming both sizes; in process, the front door names the limit."""
    huge = dict(prompt=PROMPT, image=bytes(8 * 2**20))
    assert refused_locally(door, huge) == "image of 8388608 bytes is over limits.image_bytes (1048576)"
    message = refused_by_client(door, huge)
    assert "RESOURCE_EXHAUSTED" in message and re.search(r"larger than max \(8388\d+ vs\. \d+\)", message), message


def memory() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def test_memory_is_back_after_the_bad_rows(door):
    """This process serves the front door (in process and over gRPC): after each round of the image
    rows through both, and six of the 9000x9000 image at once, its memory is within 100 MB of where
    it started, and its peak too: no big image was ever decoded (one would take 243 MB)."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak, from now
    start, _ = memory()
    for _ in range(3):
        good = door.pipe.submit(**GOOD)
        for row in IMAGE_ROWS:
            refused_locally(door, row.kwargs)
            refused_by_client(door, row.kwargs)
        with ThreadPoolExecutor(6) as pool:
            messages = list(pool.map(lambda _: refused_by_client(door, dict(prompt=PROMPT, image=BOMB)), range(6)))
        assert all("over limits.image_pixels" in m for m in messages)
        assert good.result(timeout=120).token_ids == door.expected
        now, peak = memory()
        assert now - start < 100 * 2**20, f"{(now - start) / 2**20:.0f} MB more than before the bad rows"
    assert peak - start < 100 * 2**20, f"the peak was {(peak - start) / 2**20:.0f} MB above the start"
