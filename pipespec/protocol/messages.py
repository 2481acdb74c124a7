"""The pipeline protocol's messages (design section 2). Frozen, small, and deltas only.

Positions are absolute indices into a request's generated sequence (0 = first generated token).

    coordinator -> every stage   Open, Close
    drafter     -> verifier      Draft    "my tokens at positions start.. are these"
    verifier    -> drafter       Verdict  "I agree with all you sent before `position`; there my token is `token`
                                           (and after it, `after`: a branch I had pre-drafted)"
    target      -> coordinator   Commit   "positions start.. are committed"
    target      -> dream drafter TargetFeatures  "my last-layer hidden states at context positions start.."
    every stage -> coordinator   Closed (statistics), Failed (an error in this request)

Epochs live per link. A verifier bumps its epoch whenever a drafter's tokens contradict its own; drafts
carrying an older epoch are dropped on arrival.

Fields holding arrays are annotated `Tensor` (a torch.Tensor) or `Array` (a numpy array): named here
rather than imported, so that the coordinator, which imports these messages, stays torch-free; the
codec checks a peer's frame against these annotations (pipespec.protocol.codec).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.stats import PairStats, StageStats

Tensor = Annotated[Any, "torch.Tensor"]
Array = Annotated[Any, "numpy.ndarray"]


@dataclass(frozen=True)
class ImageInputs:
    """A processed image: every array the target's processor returned but the token ids.

    `arrays` maps the processor's names to numpy arrays (pixel_values [n, ...], image_grid_thw,
    image_sizes, token_type_ids [1, L], ...); the `vlm` stage passes them to its model at prefill.
    Sent once per request, with Open, to the target only.
    """

    arrays: dict[str, Array]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclass(frozen=True)
class RequestSpec:
    """What every stage needs to open a request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    image: ImageInputs | None = None  # the target's processed image; only the target receives it
    text_prompt_token_ids: tuple[int, ...] | None = None  # image prompts: the prompt without the image
    committed: tuple[int, ...] = ()  # a rejoin: tokens already committed; the stage holds them as generated
    logprobs: int | None = None  # None: no logprobs; k: the target sends each committed token's and its k top alternatives'

    @property
    def text_prompt(self) -> tuple[int, ...]:
        """What a text-only stage sees: the prompt's text tokens, never image placeholders."""
        return self.prompt_token_ids if self.text_prompt_token_ids is None else self.text_prompt_token_ids


@dataclass(frozen=True)
class Open:
    request: RequestSpec


@dataclass(frozen=True)
class Close:
    request_id: str


@dataclass(frozen=True)
class Siblings:
    """What a drafter that offers draft trees (its `tree` section) knew at one of its tokens' positions: its
    token's value there (its calibrated log-probability, pipespec.engine.tree_drafting) and its likeliest other
    tokens with theirs, best first. Its verifier may check them beside the token, in one tree forward."""

    value: float
    tokens: tuple[int, ...] = ()
    values: tuple[float, ...] = ()


@dataclass(frozen=True)
class Draft:
    request_id: str
    epoch: int
    start: int
    tokens: tuple[int, ...]
    probs: Tensor | None = None  # [len(tokens), V] the drafter's p', rejection mode only
    token_s: float | None = None  # the drafter's recent compute seconds per token (a scheduling hint)
    siblings: tuple[Siblings, ...] = ()  # one per token, from a drafter that offers trees; else none


@dataclass(frozen=True)
class Verdict:
    """Verifier -> its drafter: the verifier holds `token` at `position`, then `after` (which a pre-drafted
    branch of its own supplied: pipespec.engine.outcome_cache), and everything before `position` as the drafter
    sent it."""

    request_id: str
    epoch: int
    position: int
    token: int
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillFeatures:
    """The target's view of the prompt (all prompt tokens but the last), for the DREAM drafter."""

    embeddings: Tensor  # [P, H] merged input embeddings (image features in place of image tokens)
    hidden: Tensor  # [P, H] last layer, post-norm
    image_mask: Tensor  # [P] bool, True at image tokens
    attention_received: Tensor | None = None  # [P] float32: last-layer attention each position received, if computed


@dataclass(frozen=True)
class TargetFeatures:
    """Target -> its DREAM drafter: features of context positions (prompt + generated) the target holds as true.

    With the prefill: `prefill` set, `hidden` None. After each verification step: `hidden` [n, H] for
    context positions start.. (the tokens it fed that it kept); sent before that step's verdict.
    """

    request_id: str
    start: int
    hidden: Tensor | None = None  # [n, H]
    prefill: PrefillFeatures | None = None


@dataclass(frozen=True)
class Commit:
    request_id: str
    start: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token, when the request asked (RequestSpec.logprobs)


@dataclass(frozen=True)
class Closed:
    request_id: str
    stage: str
    stage_stats: StageStats
    pair_stats: PairStats | None = None  # as a verifier of its drafter; None on the first stage


@dataclass(frozen=True)
class Failed:
    request_id: str
    stage: str
    error: str
    kind: str = field(default="error")


Message = Open | Close | Draft | Verdict | TargetFeatures | Commit | Closed | Failed
