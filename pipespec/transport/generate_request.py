"""`GenerateArgs` to and from the wire's `GenerateRequest`: the one place that maps one to the other.

Every field of the wire says whether it was given (`optional`, token ids in a `TokenIds`), so a
request crosses as the caller gave it: None is unset and unset is None (`max_new_tokens` unset: as
many as the pipeline's limits allow, GenerateArgs' one meaning; a sampling value unset: the config's
default). Integers are 64-bit (a seed unsigned), floats double. A `GenerateArgs` holds only good
values, and the wire carries every one of them; its image must already be encoded bytes
(`pipespec.requests.images.image_bytes`): it crosses the wire once per request. What the wire brings
is checked where it is read, by building the `GenerateArgs` (`from_proto`): a raw request with an
empty prompt, `max_new_tokens: 0` or a value out of range is a ValueError with the message
LocalPipeline gives, which the coordinator answers as a refusal.
"""

from __future__ import annotations

import reprlib
from typing import Any

from pipespec.protos import pipespec_pb2 as pb
from pipespec.requests.chat import IMAGE, ChatMessage, Part
from pipespec.requests.generate_args import SAMPLING_FIELDS, GenerateArgs

_OPTIONAL = ("prompt", "image", "max_new_tokens", "logprobs", *SAMPLING_FIELDS)  # fields with presence on the wire


def to_proto(args: GenerateArgs) -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    given: dict[str, Any] = {name: getattr(args, name) for name in _OPTIONAL}
    given["stop"] = args.stop
    given["prompt_token_ids"] = args.prompt_token_ids
    given["messages"] = args.messages
    for name, value in given.items():
        if value is None:
            continue
        try:
            if name == "prompt_token_ids":
                request.prompt_token_ids.SetInParent()  # given, even when empty
                request.prompt_token_ids.ids.extend(value)
            elif name == "stop":
                request.stop.extend(value)
            elif name == "messages":
                request.messages.extend(_message_to_proto(m) for m in value)
            else:
                setattr(request, name, value)
        except (TypeError, ValueError) as e:  # an image not yet encoded
            raise ValueError(f"GenerateRequest.{name} cannot carry {reprlib.repr(value)}: {e}") from None
    return request


def from_proto(request: pb.GenerateRequest) -> GenerateArgs:
    """The request's arguments, checked as they are built (a ValueError names a bad value); an unset field is None."""
    given = {name: getattr(request, name) if request.HasField(name) else None for name in _OPTIONAL}
    if request.HasField("prompt_token_ids"):
        given["prompt_token_ids"] = tuple(request.prompt_token_ids.ids)
    if request.messages:
        given["messages"] = tuple(ChatMessage(m.role, tuple(_part_from_proto(p) for p in m.parts)) for m in request.messages)
    return GenerateArgs(stop=tuple(request.stop), **given)


def _message_to_proto(message: ChatMessage) -> pb.ChatMessage:
    """`message` of arguments (a `ChatMessage`: building `GenerateArgs` turns mappings into them)."""
    parts = [pb.ContentPart(image=True) if p.image else pb.ContentPart(text=p.text) for p in message.parts]
    return pb.ChatMessage(role=message.role, parts=parts)


def _part_from_proto(part: pb.ContentPart) -> Part:
    return IMAGE if part.WhichOneof("kind") == "image" else Part(part.text)
