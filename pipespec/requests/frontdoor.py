"""The front door: one request's `GenerateArgs` validated into a `RequestSpec`, or a clear error.

Shared by every way in (LocalPipeline, the coordinator's gRPC service, and so the `Client` and
`pipespec generate`), so a bad value is refused with the same message everywhere, before anything
reaches a stage, and never disturbs running requests. A `GenerateArgs` was checked as it was built
(types and ranges: pipespec.requests.generate_args); here, the config's `limits`, each checked
before the work it bounds: the request's own values before anything is done, an image's bytes before
it is read and its pixels (from its header) before it is decoded (pipespec.requests.images), the
prompt's characters before it is tokenized and its tokens after. `max_new_tokens=None` is worked out
here, in its one meaning (GenerateArgs'): as many tokens as `limits.max_new_tokens` and the target's
context leave room for. An image is decoded and run through the target's processor here, once per
request. Request ids are random, so that no one can name another's request. Torch-free: it knows the
target through a `TargetInfo`, not the model.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipespec.config import LimitsSpec, PipelineConfig, StageSpec
from pipespec.protocol.messages import RequestSpec
from pipespec.requests.generate_args import GenerateArgs
from pipespec.requests.images import encode_image_prompt, encode_text_prompt, load_image
from pipespec.requests.tokenization import encode_prompt
from pipespec.schema.kinds import kind_of

if TYPE_CHECKING:
    from pipespec.engine.stage import TargetStage

CHARS_PER_TOKEN = 16  # a text prompt longer than this many characters per allowed token is not even tokenized


@dataclass(frozen=True)
class TargetInfo:
    """What the front door needs to know of the target stage."""

    name: str
    kind: str
    vocab_size: int
    max_context: int | None
    eos_token_ids: frozenset[int]
    takes_images: bool = False

    @classmethod
    def of(cls, spec: StageSpec, stage: TargetStage) -> TargetInfo:
        """What a built target stage tells the front door; whether it takes images, its kind says."""
        return cls(
            name=spec.name,
            kind=spec.kind,
            vocab_size=stage.vocab_size,
            max_context=stage.max_context,
            eos_token_ids=frozenset(stage.eos_token_ids),
            takes_images=kind_of(spec).takes_images,
        )


class FrontDoor:
    def __init__(self, config: PipelineConfig, target: TargetInfo, tokenizer: Any | None, processor: Any | None = None):
        """`processor`: the image target's Hugging Face processor (see pipespec.requests.images), None for text targets."""
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.processor = processor

    def request(self, args: GenerateArgs) -> tuple[RequestSpec, tuple[str, ...]]:
        """Validate one request; sampling defaults come from the config. Raises ValueError naming the
        value, or the limit (`limits.<name>` of the config) and the value over it."""
        target, limits = self.target, self.config.limits
        _within_limits(args, limits)
        if args.image is not None and not target.takes_images:
            raise ValueError(f"target stage {target.name!r} ({target.kind}) does not take images")
        if args.image is not None and args.prompt_token_ids is not None:
            raise ValueError("an image needs a text prompt (the processor places its image tokens), not prompt_token_ids")
        image_prompt = None
        if args.prompt_token_ids is not None:
            ids = list(args.prompt_token_ids)
        elif args.image is not None:
            image_prompt = encode_image_prompt(self.processor, args.conversation(), load_image(args.image, limits))
            ids = list(image_prompt.prompt_token_ids)
        elif self.processor is not None:
            ids = encode_text_prompt(self.processor, args.conversation())
        elif self.tokenizer is not None:
            ids = encode_prompt(self.tokenizer, args.conversation())
        else:
            raise ValueError("this pipeline has no tokenizer (mock stages): pass prompt_token_ids")
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(ids) > limits.prompt_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens is over limits.prompt_tokens ({limits.prompt_tokens})")
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {target.vocab_size}")
        max_new_tokens = self._max_new_tokens(args.max_new_tokens, len(ids))
        if args.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this pipeline has none (mock stages)")
        params = self.config.sampling.params(**args.sampling())
        spec = RequestSpec(
            request_id=new_request_id(),
            prompt_token_ids=tuple(ids),
            params=params,
            max_new_tokens=max_new_tokens,
            stop_token_ids=target.eos_token_ids,
            image=image_prompt.image if image_prompt else None,
            text_prompt_token_ids=image_prompt.text_prompt_token_ids if image_prompt else None,
            logprobs=args.logprobs,
        )
        return spec, args.stop

    def _max_new_tokens(self, asked: int | None, prompt: int) -> int:
        """What a request of `prompt` tokens may generate: `asked`, or (None) as many as
        `limits.max_new_tokens` and the target's context allow. A ValueError if the context has no room."""
        target, most = self.target, self.config.limits.max_new_tokens
        if asked is None and target.max_context is None:
            return most
        if asked is None:
            if prompt < target.max_context:
                return min(most, target.max_context - prompt)
            raise ValueError(
                f"prompt of {prompt} tokens + 1 new token exceeds the context of {target.max_context} tokens of "
                f"target {target.name!r}"
            )
        if target.max_context is not None and prompt + asked > target.max_context:
            raise ValueError(
                f"prompt of {prompt} tokens + max_new_tokens {asked} exceeds the context of "
                f"{target.max_context} tokens of target {target.name!r}"
            )
        return asked

    def plain_text_ids(self, text: str) -> list[int]:
        """`text` tokenized as it is, without the chat template (the tokenizer's own special tokens
        added, as vLLM's completions do), after the same character check as a prompt: a text too long
        is refused before it is tokenized. Its tokens are counted by `request`, as `prompt_token_ids`."""
        _within_characters(len(text), self.config.limits)
        if not text:
            raise ValueError("the prompt is empty: give some text")
        if self.tokenizer is None:
            raise ValueError("this pipeline has no tokenizer (mock stages): give the prompt as token ids")
        return list(self.tokenizer.encode(text))


def request_bytes(limits: LimitsSpec) -> int:
    """The largest `GenerateRequest` the coordinator reads: an image at `limits.image_bytes`, a prompt
    at `limits.prompt_tokens` (text of up to CHARS_PER_TOKEN characters of up to 4 bytes a token, or
    ids of up to 10 bytes), stop strings at theirs, and 64 KiB for the rest. The coordinator's gRPC
    server and HTTP server read nothing larger (pipespec.transport.coordinator_service,
    pipespec.serving.body_limit)."""
    prompt = limits.prompt_tokens * max(4 * CHARS_PER_TOKEN, 10)
    stops = limits.stop_strings * (4 * limits.stop_chars + 8)
    return limits.image_bytes + prompt + stops + 64 * 2**10


def new_request_id() -> str:
    """A request id no one can guess (128 random bits), so that no one can name another's request."""
    return f"req-{secrets.token_hex(16)}"


def _within_limits(args: GenerateArgs, limits: LimitsSpec) -> None:
    """The limits a request's own values can break, before any work is done on it."""
    if args.max_new_tokens is not None and args.max_new_tokens > limits.max_new_tokens:
        raise ValueError(f"max_new_tokens {args.max_new_tokens} is over limits.max_new_tokens ({limits.max_new_tokens})")
    if len(args.stop) > limits.stop_strings:
        raise ValueError(f"{len(args.stop)} stop strings are over limits.stop_strings ({limits.stop_strings})")
    for i, stop in enumerate(args.stop):
        if len(stop) > limits.stop_chars:
            raise ValueError(f"stop[{i}] of {len(stop)} characters is over limits.stop_chars ({limits.stop_chars})")
    if args.prompt_token_ids is not None and len(args.prompt_token_ids) > limits.prompt_tokens:
        raise ValueError(f"prompt of {len(args.prompt_token_ids)} tokens is over limits.prompt_tokens ({limits.prompt_tokens})")
    if args.prompt is not None:
        _within_characters(len(args.prompt), limits)
    elif args.messages is not None:
        _within_characters(sum(max(len(m.text), CHARS_PER_TOKEN) for m in args.messages), limits, len(args.messages))


def _within_characters(chars: int, limits: LimitsSpec, messages: int | None = None) -> None:
    """A prompt's text, before it is tokenized: at most CHARS_PER_TOKEN characters a token of
    `limits.prompt_tokens`; each of a conversation's `messages` counts as at least CHARS_PER_TOKEN
    characters (it costs at least a token of the chat template), so that no flood of empty messages
    is rendered."""
    if chars <= CHARS_PER_TOKEN * limits.prompt_tokens:
        return
    what = (
        f"prompt of {chars} characters is"
        if messages is None
        else f"{messages} messages counted as {chars} characters (each at least {CHARS_PER_TOKEN}) are"
    )
    raise ValueError(
        f"{what} over limits.prompt_tokens ({limits.prompt_tokens}): a text of more than {CHARS_PER_TOKEN} "
        "characters a token is refused before it is tokenized"
    )
