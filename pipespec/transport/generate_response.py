"""`Delta` to and from the wire's `GenerateResponse`: the one place that maps one to the other.

A chunk carries text, token ids and (when asked for) their logprobs; the finish carries the reason
and the request's statistics as plain protobuf messages (RequestStats, PairStats, StageStats), so a
client in any language reads them; an error carries its message. The front door's refusal is an
error before the request was admitted, so without a request id (`refusal`, `refused`): a client
raises `RequestRefused` for it, `GenerationError` for an error during the request.
"""

from __future__ import annotations

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.stats import PairStats, RequestStats, StageStats
from pipespec.protos import pipespec_pb2 as pb
from pipespec.requests.outputs import Delta

_PAIR = ("drafter", "verifier", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_rejections", "num_nodes")
_STAGE = (
    "stage",
    "forwards",
    "tokens_fed",
    "rollbacks",
    "dropped_drafts",
    "compute_s",
    "predraft_hits",
    "predraft_misses",
    "predraft_tokens",
    "predraft_forwards",
    "relayed_drafts",
)
_REQUEST = ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s")


def to_responses(request_id: str, delta: Delta) -> list[pb.GenerateResponse]:
    """One delta -> its responses: a chunk if it holds tokens, then its finish or its error."""
    out = []
    if delta.text or delta.token_ids:
        chunk = pb.Chunk(text=delta.text, token_ids=delta.token_ids, logprobs=[_logprobs_to_proto(lp) for lp in delta.logprobs])
        out.append(pb.GenerateResponse(request_id=request_id, chunk=chunk))
    if delta.finish_reason == "error":
        out.append(pb.GenerateResponse(request_id=request_id, error=pb.Error(message=delta.error or "error")))
    elif delta.finish_reason is not None:
        stats = stats_to_proto(delta.stats) if delta.stats is not None else None
        finished = pb.Finished(finish_reason=delta.finish_reason, stats=stats)
        out.append(pb.GenerateResponse(request_id=request_id, finished=finished))
    return out


def refusal(message: str) -> pb.GenerateResponse:
    """The front door's refusal of a request, naming the value: an error with no request id (none was given)."""
    return pb.GenerateResponse(error=pb.Error(message=message))


def refused(response: pb.GenerateResponse) -> bool:
    """Whether `response` is the front door's refusal (`refusal`), not an error during the request."""
    return response.WhichOneof("kind") == "error" and not response.request_id


def to_delta(response: pb.GenerateResponse) -> Delta:
    kind = response.WhichOneof("kind")
    if kind == "chunk":
        chunk = response.chunk
        return Delta(chunk.text, tuple(chunk.token_ids), logprobs=tuple(_logprobs_from_proto(lp) for lp in chunk.logprobs))
    if kind == "finished":
        finished = response.finished
        return Delta("", (), finished.finish_reason, stats_from_proto(finished.stats) if finished.HasField("stats") else None)
    return Delta("", (), "error", None, response.error.message)


def stats_to_proto(stats: RequestStats) -> pb.RequestStats:
    return pb.RequestStats(
        **{name: getattr(stats, name) for name in _REQUEST},
        pairs=[
            pb.PairStats(**{n: getattr(p, n) for n in _PAIR}, accepted_per_position=p.accepted_per_position) for p in stats.pairs
        ],
        stages=[pb.StageStats(**{n: getattr(s, n) for n in _STAGE}) for s in stats.stages],
    )


def stats_from_proto(stats: pb.RequestStats) -> RequestStats:
    return RequestStats(
        **{name: getattr(stats, name) for name in _REQUEST},
        pairs=[
            PairStats(**{n: getattr(p, n) for n in _PAIR}, accepted_per_position=list(p.accepted_per_position))
            for p in stats.pairs
        ],
        stages=[StageStats(**{n: getattr(s, n) for n in _STAGE}) for s in stats.stages],
    )


def _logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token=lp.token, logprob=lp.logprob, top=[pb.TopLogprob(token=t, logprob=v) for t, v in lp.top])


def _logprobs_from_proto(lp: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(lp.token, lp.logprob, tuple(t.token for t in lp.top), tuple(t.logprob for t in lp.top))
