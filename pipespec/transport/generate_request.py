"""`GenerateArgs` to and from the wire's `GenerateRequest`: the one place that maps one to the other.

proto3 has no None for a string, a bytes or a repeated field: an absent prompt, prompt_token_ids or
image goes as empty and an empty one comes back as absent (the prompt only when token ids are
given: they take its place); an unset `max_new_tokens` (0) is the default. The sampling fields are
`optional` on the wire, so None (the config's default) survives the trip. The image must already be
encoded bytes (`pipespec.images.image_bytes`): it crosses the wire once per request.
"""

from __future__ import annotations

from pipespec.generate_args import SAMPLING_FIELDS, GenerateArgs
from pipespec.protos import pipespec_pb2 as pb


def to_proto(args: GenerateArgs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=args.prompt or "",
        prompt_token_ids=args.prompt_token_ids or (),
        image=args.image or b"",
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        **{name: value for name, value in args.sampling().items() if value is not None},
    )


def from_proto(request: pb.GenerateRequest) -> GenerateArgs:
    given = {name: getattr(request, name) for name in SAMPLING_FIELDS if request.HasField(name)}
    if request.max_new_tokens:
        given["max_new_tokens"] = request.max_new_tokens
    return GenerateArgs(
        prompt=request.prompt if not request.prompt_token_ids else None,
        prompt_token_ids=tuple(request.prompt_token_ids) or None,
        image=request.image or None,
        stop=tuple(request.stop),
        **given,
    )
