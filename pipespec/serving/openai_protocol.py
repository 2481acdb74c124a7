"""The OpenAI API's requests, as the HTTP server takes them: pydantic models that refuse unknown fields by name.

    body = ChatCompletionRequest.model_validate(json)   # a ValidationError names the field
    args = body.args(allowed_media)                     # the request's GenerateArgs (every choice's)
    seeds = body.seeds()                                # choice i's seed

`ChatCompletionRequest` (POST /v1/chat/completions) and `CompletionRequest` (POST /v1/completions)
take the fields pipespec serves: `max_tokens` (`max_completion_tokens` first for chat), `temperature`,
`top_p`, `top_k` (vLLM's extension), `seed`, `stop`, `n`, `stream`, `stream_options.include_usage` and
logprobs (chat: `logprobs` true with `top_logprobs` alternatives; completions: `logprobs` k). Any
other field is refused by name, as one pipespec does not honour: a client learns it was ignored.
Types are checked here, strictly (no string or bool taken for a number), and the bounds of fields
only HTTP has (`n`, `top_logprobs` <= 5); the other values and ranges where every way in checks them
(building the `GenerateArgs`, then the front door's limits), so every way in refuses them with the
same message (`max_tokens: 0` as `max_new_tokens=0` is, named `max_tokens`). The messages, as they
came, are parsed by pipespec.requests.chat (`conversation`, the one parser of content parts); their
image, a data URL or a file under the allowed directory (pipespec.serving.media).

`max_tokens` (and `max_completion_tokens`) left out or null: `max_new_tokens=None`, as many tokens
as the pipeline's limits allow (as OpenAI and vLLM do; its one meaning: pipespec.requests.generate_args).
`n` choices are one request admitted once, choice i seeded `seed + i`; with no `seed`, a seed is
drawn at random for each request (as OpenAI and vLLM: repeated requests differ when sampling, the
config's seed is not used), so the choices differ when sampling and each equals the target alone
with its seed.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipespec.requests import chat
from pipespec.requests.generate_args import MAX_LOGPROBS, GenerateArgs
from pipespec.serving.media import media_image

MAX_CHOICES = 16  # the most choices (`n`) one request may ask for
SEED_BITS = 63  # a seed drawn for a request without one: room left for `+ i` below 2**64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None  # None: as many as the pipeline's limits allow; its range: GenerateArgs'
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def renamed(self) -> dict[str, str]:
        """The front door's names of fields this request names otherwise (GenerateArgs -> OpenAI)."""
        return {"max_new_tokens": "max_tokens"}

    def check(self) -> None:
        """What the fields say together; a ValueError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")

    def seeds(self) -> list[int]:
        """Each choice's seed: `seed + i`, from a seed drawn at random when none is given."""
        first = self.seed if self.seed is not None else secrets.randbits(SEED_BITS)
        return [first + i for i in range(self.n)]

    def _args(self, max_new_tokens: int | None, **prompt: Any) -> GenerateArgs:
        sampling = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=self.stop)
        return GenerateArgs(max_new_tokens=max_new_tokens, **sampling, **prompt)  # checked here, as every way in


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]] = Field(max_length=chat.MAX_MESSAGES)  # parsed by pipespec.requests.chat.conversation
    max_completion_tokens: int | None = None  # as max_tokens, and first
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def renamed(self) -> dict[str, str]:
        given = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"max_new_tokens": given, "prompt_token_ids": "the prompt of /v1/completions as a list of token ids"}

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")

    def args(self, allowed_media: Path | None) -> GenerateArgs:
        """The request's arguments: its messages parsed, their image resolved (a ValueError names a bad one)."""
        messages, image = chat.conversation(self.messages)
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._args(
            limit,
            messages=messages,
            image=None if image is None else media_image(image, allowed_media),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]  # text (tokenized as it is: FrontDoor.plain_text_ids) or token ids
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @property
    def renamed(self) -> dict[str, str]:
        return {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}

    def check(self) -> None:
        super().check()
        if self.echo:
            raise ValueError("echo is not supported: the completion holds the generated text only")

    def args(self, prompt_token_ids: list[int]) -> GenerateArgs:
        """The request's arguments, its prompt as token ids (a text tokenized by the front door)."""
        return self._args(self.max_tokens, prompt_token_ids=prompt_token_ids, logprobs=self.logprobs)
