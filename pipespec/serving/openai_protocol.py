"""The OpenAI API's requests, as the HTTP server takes them: pydantic models that refuse unknown fields by name.

    body = ChatCompletionRequest.model_validate(json)   # a ValidationError names the field
    args = body.choice_args(i, allowed_media, default_seed)  # choice i's GenerateArgs

`ChatCompletionRequest` (POST /v1/chat/completions) and `CompletionRequest` (POST /v1/completions)
take the fields pipespec serves: `max_tokens` (`max_completion_tokens` first for chat), `temperature`,
`top_p`, `top_k` (vLLM's extension), `seed`, `stop`, `n`, `stream`, `stream_options.include_usage` and
logprobs (chat: `logprobs` true with `top_logprobs` alternatives; completions: `logprobs` k). Any
other field is refused by name, as one pipespec does not honour: a client learns it was ignored.
Types are checked here, strictly (no string or bool taken for a number); values and ranges by the
front door (`GenerateArgs.checked`, the config's limits), so every way in refuses them with the same
message. `max_tokens` not given: GenerateArgs' default. `n` choices run as n requests, choice
i seeded `seed + i` (the config's seed when none is given), so they differ when sampling and each
equals the target alone with its seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipespec.frontdoor import CHARS_PER_TOKEN, FrontDoor
from pipespec.generate_args import GenerateArgs
from pipespec.serving.media import media_image

MAX_CHOICES = 16  # the most choices (`n`) one request may ask for


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the target's processor decides the detail


class Part(_Strict):
    """A part of a message's content: `{"type": "text", "text": ...}` or `{"type": "image_url", "image_url": {"url": ...}}`."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Part:
        given = "text" if self.text is not None else "image_url" if self.image_url is not None else None
        if given != self.type or (self.text is not None and self.image_url is not None):
            raise ValueError(f'a {self.type} part has exactly one field beside type: "{self.type}"')
        return self


class Message(_Strict):
    role: str  # the front door names a role it does not know (pipespec.chat.ROLES)
    content: str | list[Part]

    def as_mapping(self, allowed_media: Path | None) -> dict:
        """The OpenAI-shaped message pipespec.chat reads, an image URL resolved (pipespec.serving.media)."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        parts = [
            {"type": "text", "text": p.text}
            if p.image_url is None
            else {"type": "image", "image": media_image(p.image_url.url, allowed_media)}
            for p in self.content
        ]
        return {"role": self.role, "content": parts}


class GenerationRequest(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
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

    def check(self) -> None:
        """What the fields say together; a ValueError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")

    def _sampling(self, i: int, default_seed: int) -> dict:
        """Choice i's keywords of GenerateArgs (None: the config's default)."""
        seed = self.seed if self.n == 1 else (self.seed if self.seed is not None else default_seed) + i
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed, stop=self.stop)


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")

    def choice_args(self, i: int, allowed_media: Path | None, default_seed: int) -> GenerateArgs:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return GenerateArgs(
            messages=[m.as_mapping(allowed_media) for m in self.messages],
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            **({"max_new_tokens": limit} if limit is not None else {}),
            **self._sampling(i, default_seed),
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]  # text (not run through a chat template) or token ids
    logprobs: int | None = None
    echo: bool = False

    def check(self) -> None:
        super().check()
        if self.echo:
            raise ValueError("echo is not supported: the completion holds the generated text only")

    def prompt_ids(self, front_door: FrontDoor) -> list[int]:
        """The prompt's token ids: as given, or its text tokenized as it is (no chat template; the
        tokenizer's own special tokens added, as vLLM does). A text too long is refused before it is
        tokenized, with the front door's measure; its tokens are counted by the front door."""
        if not isinstance(self.prompt, str):
            return self.prompt
        limit = front_door.config.limits.prompt_tokens
        if len(self.prompt) > CHARS_PER_TOKEN * limit:
            raise ValueError(
                f"prompt of {len(self.prompt)} characters is over limits.prompt_tokens ({limit}): a text of "
                f"more than {CHARS_PER_TOKEN} characters a token is refused before it is tokenized"
            )
        if not self.prompt:
            raise ValueError("the prompt is empty: give some text (or token ids)")
        if front_door.tokenizer is None:
            raise ValueError("this pipeline has no tokenizer (mock stages): give the prompt as token ids")
        return list(front_door.tokenizer.encode(self.prompt))

    def choice_args(self, i: int, prompt_token_ids: list[int], default_seed: int) -> GenerateArgs:
        """Choice i's arguments, the prompt tokenized by `prompt_ids`."""
        return GenerateArgs(
            prompt_token_ids=prompt_token_ids,
            logprobs=self.logprobs,
            **({"max_new_tokens": self.max_tokens} if self.max_tokens is not None else {}),
            **self._sampling(i, default_seed),
        )
