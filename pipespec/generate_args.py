"""`GenerateArgs`: one request's arguments, as every way in takes them.

The keywords of `LocalPipeline.generate` and `Client.stream` / `generate`, held in one value: the
front door validates it into a `RequestSpec` (pipespec.frontdoor), and the transport carries it as a
`GenerateRequest` (pipespec.transport.generate_request, the one place that maps it to the wire).
Sampling values left as None take the pipeline config's defaults (its `sampling` section). Only the
front door validates: a `GenerateArgs` may hold a bad value, so that it is refused the same way
everywhere. Torch-free.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")  # None: the config's default


@dataclass(frozen=True)
class GenerateArgs:
    """`generate(prompt=None, *, prompt_token_ids=None, ...)`'s keywords: give exactly one of `prompt`
    and `prompt_token_ids` (which bypasses tokenizer and chat template). `prompt_token_ids` and `stop`
    may be any sequence; they are kept as tuples."""

    prompt: str | None = None
    _: KW_ONLY
    prompt_token_ids: tuple[int, ...] | None = None
    image: Any = None  # a PIL image, encoded bytes, a path or a URL (pipespec.images); encoded bytes on the wire
    max_new_tokens: int = 64
    temperature: float | None = None  # None: the config's default
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; None is none

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop or ()))

    def sampling(self) -> dict[str, float | int | None]:
        """The sampling overrides, None where the config's default applies."""
        return {name: getattr(self, name) for name in SAMPLING_FIELDS}
