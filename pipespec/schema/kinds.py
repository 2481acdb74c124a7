"""The table of stage kinds: one `StageKind` per value a config's `kind` can take, and what it implies.

An entry says which YAML keys the kind adds (`options`, a frozen dataclass that checks its own values),
whether it loads a model directory, where in a chain it may sit (`place`), and its capabilities: taking
images, reading the target's features (a DREAM drafter) or giving them (a target a DREAM drafter sits right
before), learning from the target's commits (a STAND drafter), depending on the stages after it (a mock
emulates its agreement with them). The config and the runtime ask `kind_of(spec)` instead of comparing kind
strings. How a stage of a kind is built lives with its stage class; `pipespec.stages.build` maps the kinds'
names to their builders, so adding a kind is its stage module, one entry here and one there.

Below the config: it imports the standard library and `pipespec.errors` only (no config, no stage
module, no torch), and reads a stage's spec structurally (`SpecLike`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipespec.errors import ConfigError


class SpecLike(Protocol):
    """What this table reads of a stage's spec (a `pipespec.config.StageSpec`)."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def options(self) -> Any: ...  # the kind's options (an instance of `StageKind.options`), or None


class KindOptions(Protocol):
    """A kind's own YAML keys: a frozen dataclass whose fields (float, int, bool, `int | None`, `float | None` or
    `bool | None`) have defaults."""

    def check(self, where: str) -> None:
        """Raise a ConfigError naming `where` (the stage's key path) if a value is out of range."""
        ...


@dataclass(frozen=True)
class MockOptions:
    """A deterministic toy model, for protocol tests and scaling experiments (not a real model).

    Its logits at a position depend on the two previous context tokens and the position. With
    probability `agreement` (decided per position by a hash) they equal the next stage's logits;
    otherwise they are independent random logits, in which, with probability `runner_up` (another
    hash), the next stage's token ranks second, and with probability `third` third: how often a real
    drafter ranks its verifier's token there where the two disagree (dev/draft_ranks.py measures
    it), which is what pre-drafting (pipespec.engine.outcome_cache) bets on. A forward call on the
    compute thread lasts `latency_ms`, plus `per_token_ms` per fed token: the mock's own arithmetic, then
    a sleep for the rest.
    """

    agreement: float = field(default=0.8, metadata={"doc": "how often its logits equal the next stage's"})
    runner_up: float = field(default=0.0, metadata={"doc": "where they differ, how often the next stage's token ranks 2nd"})
    third: float = field(default=0.0, metadata={"doc": "where they differ, how often the next stage's token ranks 3rd"})
    latency_ms: float = field(default=0.0, metadata={"doc": "what a forward lasts"})
    per_token_ms: float = field(default=0.0, metadata={"doc": "what a forward lasts more, per fed token"})
    vocab_size: int = field(default=256, metadata={"doc": "its logits' width (every mock of a chain the same)"})
    scale: float = field(default=3.0, metadata={"doc": "std-like scale of its random logits; larger: peakier"})
    eos_token_id: int | None = field(default=None, metadata={"doc": "a token that ends a generation; null: none"})
    seed: int = field(default=0, metadata={"doc": "its logits' seed"})

    def check(self, where: str) -> None:
        for name in ("agreement", "runner_up", "third"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{where}.{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.runner_up + self.third > 1.0:
            raise ConfigError(f"{where}.runner_up + third: shares of one event, at most 1, got {self.runner_up + self.third}")
        if self.latency_ms < 0 or self.per_token_ms < 0:
            raise ConfigError(f"{where}.latency_ms / per_token_ms: must be >= 0")
        if self.vocab_size < 2:
            raise ConfigError(f"{where}.vocab_size: must be >= 2, got {self.vocab_size}")
        if self.third and self.vocab_size < 3:
            raise ConfigError(f"{where}.third: a vocabulary of {self.vocab_size} has no third place")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"{where}.eos_token_id: {self.eos_token_id} is outside the vocabulary")


@dataclass(frozen=True)
class NgramOptions:
    """Prompt-lookup drafter: propose what followed the longest earlier match of the context's suffix."""

    min_n: int = field(default=1, metadata={"doc": "the shortest suffix it looks up"})
    max_n: int = field(default=4, metadata={"doc": "the longest suffix it looks up"})

    def check(self, where: str) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"{where}.min_n / max_n: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")


MAX_STAND_TOP_K = 64  # the top logprobs a target sends with each committed token, for a STAND drafter


@dataclass(frozen=True)
class StandOptions:
    """STAND drafter (pipespec.stages.stand): proposes the target's own distribution after the longest of its
    context's last min_n .. max_n tokens it has seen the target commit after, keeping the target's `top_k`
    likeliest tokens per context (the target sends that many top logprobs with every token it commits), for at
    most `max_contexts` contexts (the least recently taught forgotten; about a kilobyte each); else prompt lookup
    over the same n."""

    min_n: int = field(default=1, metadata={"doc": "the shortest context it keeps and looks up"})
    max_n: int = field(default=4, metadata={"doc": "the longest context it keeps and looks up"})
    top_k: int = field(default=8, metadata={"doc": f"the target's likeliest tokens kept per context (at most {MAX_STAND_TOP_K})"})
    max_contexts: int = field(default=100_000, metadata={"doc": "contexts kept at most (about a kilobyte each)"})

    def check(self, where: str) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"{where}.min_n / max_n: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if not 1 <= self.top_k <= MAX_STAND_TOP_K:
            raise ConfigError(f"{where}.top_k: must be from 1 to {MAX_STAND_TOP_K} tokens, got {self.top_k}")
        if self.max_contexts < 1:
            raise ConfigError(f"{where}.max_contexts: must be >= 1, got {self.max_contexts}")


@dataclass(frozen=True)
class ModelOptions:
    """How a model's forwards run (causal_lm, dream, vlm; pipespec.stages.forwards).

    A request's context holds at most `max_context` tokens (None: the model's own limit, at most 4096); its
    KV cache, what it can use (pipespec.stages.kv_pool). Each decode or verification forward feeds a fixed width: at most `max_width` tokens, a
    shorter feed padded up to a power-of-two width of at least `min_width` (None: for the target, the
    least width that keeps a position's logits independent of its block on the stage's device and
    dtype, as measured; for a drafter 1, since its logits never decide the answer).
    `compile` runs those forwards compiled, each row bucket compiled once when the stage starts (None: the
    `PIPESPEC_COMPILE` environment variable if set, else yes). `kv_budget_gib` bounds the KV caches its
    requests hold (None: a quarter of the device's memory); a request whose cache does not fit waits for
    others to finish (pipespec.stages.kv_pool). A prompt goes in by chunks of at most `prefill_chunk` tokens, one
    forward each, between the running requests' steps, several requests' chunks in one forward up to that many
    tokens in all (pipespec.engine.stage.ChunkedPrefillStage).
    """

    compile: bool | None = field(
        default=None, metadata={"doc": "compile its forwards when it starts; null: PIPESPEC_COMPILE if set, else yes"}
    )
    max_context: int | None = field(
        default=None, metadata={"doc": "most context tokens a request holds; null: the model's limit, at most 4096"}
    )
    min_width: int | None = field(
        default=None,
        metadata={"doc": "the narrowest forward (a power of two); null: the target's measured least, a drafter's 1"},
    )
    max_width: int = field(default=8, metadata={"doc": "the widest decode or verification forward (a power of two)"})
    kv_budget_gib: float | None = field(
        default=None, metadata={"doc": "what its requests' KV caches may hold; null: a quarter of the device's memory"}
    )
    prefill_chunk: int = field(default=512, metadata={"doc": "most prompt tokens a prefill forward feeds"})

    def check(self, where: str) -> None:
        if self.prefill_chunk < 1:
            raise ConfigError(f"{where}.prefill_chunk: must be >= 1 token, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"{where}.max_context: must be >= 2, got {self.max_context}")
        if self.kv_budget_gib is not None and not self.kv_budget_gib > 0:
            raise ConfigError(f"{where}.kv_budget_gib: must be > 0 GiB, got {self.kv_budget_gib}")
        if self.max_width < 1 or self.max_width & (self.max_width - 1):
            raise ConfigError(f"{where}.max_width: must be a power of two >= 1, got {self.max_width}")
        if self.min_width is not None and not (
            1 <= self.min_width <= self.max_width and not self.min_width & (self.min_width - 1)
        ):
            raise ConfigError(
                f"{where}.min_width: must be a power of two from 1 to max_width ({self.max_width}), got {self.min_width}"
            )


@dataclass(frozen=True)
class DreamOptions(ModelOptions):
    """A dream stage's forwards (`ModelOptions`), and `refresh`: whether a target feature that replaces
    an own one, which the stage's later positions already read, makes its next forward feed those
    positions again so that their cached keys come from the target's feature (true), or leaves those
    keys as they are, later positions reading the target's feature from the memory (false, the
    default: its forwards stay one token wide, for about the same acceptance)."""

    refresh: bool = field(
        default=False,
        metadata={
            "doc": "once the target's feature replaces its own at a position later ones read, feed those again (true), "
            "or let only positions fed later read it (false)"
        },
    )


def _anywhere(chain: Sequence[SpecLike], i: int) -> None:
    """A kind that may sit at any place of a chain."""


@dataclass(frozen=True)
class StageKind:
    """Everything the config and the runtime ask of one stage kind: its options, where it may sit in a
    chain and what it can do."""

    name: str  # what a config's `kind` says
    loads_model: bool = False  # `model` is required, a directory from_pretrained loads; other kinds take none
    options: type[KindOptions] | None = None  # the kind's own YAML keys, beside the common ones
    place: Callable[[Sequence[SpecLike], int], None] = _anywhere  # raises a ConfigError if stage i cannot be of this kind
    takes_images: bool = False  # as the target, it takes an image with the prompt (pipespec.requests.images)
    reads_target_features: bool = False  # its sessions read its verifier's features (a DREAM drafter)
    learns_from_commits: bool = False  # the coordinator relays it the target's commits, with top logprobs (a STAND drafter)
    gives_target_features: bool = False  # its sessions give the features a DREAM drafter right before it reads
    depends_on_chain: bool = False  # built from the options of every stage after it: one stage per chain
    batches: bool = False  # one forward carries several requests (pipespec.engine.stage.BatchingStage): `max_batch` > 1


# ---- places in a chain ------------------------------------------------------------------------------


def _first_only(chain: Sequence[SpecLike], i: int) -> None:
    """A weightless drafter (ngram, stand)."""
    if i != 0:
        raise ConfigError(
            f"stages[{i}] ({chain[i].name}): kind {chain[i].kind!r} has no model to verify with; it can only be first"
        )
    if len(chain) == 1:
        raise ConfigError(f"stages[0] ({chain[0].name}): kind {chain[0].kind!r} only drafts; it cannot be the target")


def _right_before_a_feature_giving_target(chain: Sequence[SpecLike], i: int) -> None:
    name = chain[i].name
    if i == len(chain) - 1:
        raise ConfigError(f"stages[{i}] ({name}): a dream drafter cannot be the target")
    if i != len(chain) - 2 or not kind_of(chain[-1]).gives_target_features:
        raise ConfigError(
            f"stages[{i}] ({name}): a dream drafter reads the target's hidden states, so it must come right "
            f"before a vlm target (here followed by {chain[i + 1].name!r}, kind {chain[i + 1].kind})"
        )


def _before_mocks_only(chain: Sequence[SpecLike], i: int) -> None:
    if any(t.kind != "mock" for t in chain[i + 1 :]):
        raise ConfigError(
            f"stages[{i}] ({chain[i].name}): a mock stage emulates its agreement with the stages after it, so they must be mocks too"
        )
    sizes = [s.options.vocab_size for s in chain[i:]]  # every mock of the chain when i is the first
    if len(set(sizes)) > 1:
        raise ConfigError("stages: mock stages have different vocab_size values " + str(sizes))


# ---- the table --------------------------------------------------------------------------------------

KINDS: Mapping[str, StageKind] = {
    kind.name: kind
    for kind in (  # in the order error messages list them
        StageKind("causal_lm", loads_model=True, options=ModelOptions, batches=True),
        StageKind("ngram", options=NgramOptions, place=_first_only),
        StageKind("stand", options=StandOptions, place=_first_only, learns_from_commits=True),
        StageKind(
            "dream",
            loads_model=True,
            options=DreamOptions,
            place=_right_before_a_feature_giving_target,
            reads_target_features=True,
            batches=True,
        ),
        StageKind("vlm", loads_model=True, options=ModelOptions, takes_images=True, gives_target_features=True, batches=True),
        StageKind("mock", options=MockOptions, place=_before_mocks_only, depends_on_chain=True, batches=True),
    )
}


def kind_of(spec: SpecLike) -> StageKind:
    """The table's entry of `spec.kind` (load_config has checked it is one)."""
    kind = KINDS.get(spec.kind)
    if kind is None:
        raise ConfigError(f"stage {spec.name!r}: kind {spec.kind!r} is not available in this build yet")
    return kind
