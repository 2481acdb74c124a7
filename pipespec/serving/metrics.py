"""Prometheus metrics of one served pipeline, named like vLLM's (prefix `pipespec:`).

    metrics = Metrics(pairs=[("tiny", "mid"), ("mid", "target")])
    record = metrics.request(prompt_tokens=12, arrived=time.perf_counter())
    record.observe(delta)      # each delta as it streams
    record.close()             # when the stream ends, finished or not
    metrics.exposition()       # the text format, for GET /metrics

Each `Metrics` has its own `CollectorRegistry`, so several pipelines in one process do not clash.
Speculative decoding, per drafter -> verifier pair, from each finished request's statistics
(pipespec.protocol.stats.PairStats): `pipespec:spec_decode_num_drafts_total` (verification steps that saw
drafts), `..._num_draft_tokens_total`, `..._num_accepted_tokens_total` and
`..._num_accepted_tokens_per_pos_total{position}` (steps that accepted draft index `position`, from 0;
they sum to the accepted tokens), and `..._num_nodes_total` (the draft-tree nodes checked: the drafts and the
siblings beside them; a chain's, its drafts). Pre-drafting, per stage (pipespec.engine.outcome_cache, StageStats):
`pipespec:predraft_hits_total`, `..._misses_total`, `..._tokens_total` and `..._forwards_total`; a middle stage's
drafts passed on unchecked under load (`relay_above`): `pipespec:relayed_drafts_total`. KV memory, per
stage: `pipespec:kv_cache_usage_perc{stage}` (the share of its budget its requests held when it last finished
one, pipespec.stages.kv_pool). Requests, as vLLM splits them: `pipespec:num_requests_waiting` (in flight, no
token streamed yet: waiting for memory, or in their prefill) and `pipespec:num_requests_running` (streaming),
`pipespec:request_success_total{finished_reason}` (stop, length, abort, error: every finished
request, as vLLM counts them), `pipespec:prompt_tokens_total`, `pipespec:generation_tokens_total`.
Latency histograms, from the request's arrival at the front door: `pipespec:time_to_first_token_seconds`,
`pipespec:inter_token_latency_seconds` (between deltas carrying tokens: the target commits several
tokens at once, as one vLLM engine step outputs several under speculation) and
`pipespec:e2e_request_latency_seconds`. A request whose client left before its finish counts as
aborted; the statistics of its drafts never reach it, so the speculative counters leave it out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipespec.protocol.stats import PairStats, StageStats
from pipespec.requests.outputs import Delta

PAIR = ("drafter", "verifier")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pairs: Sequence[tuple[str, str]] = ()):
        """`pairs`: the pipeline's (drafter, verifier) stage pairs, shown at 0 before any request."""
        self.registry = registry = CollectorRegistry()
        self.drafts = Counter(
            "pipespec:spec_decode_num_drafts", "Verification steps that checked drafts.", PAIR, registry=registry
        )
        self.draft_tokens = Counter(
            "pipespec:spec_decode_num_draft_tokens", "Draft tokens checked by the verifier.", PAIR, registry=registry
        )
        self.accepted_tokens = Counter(
            "pipespec:spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier.", PAIR, registry=registry
        )
        self.nodes = Counter(
            "pipespec:spec_decode_num_nodes",
            "Draft-tree nodes checked by the verifier: the drafts and the siblings beside them.",
            PAIR,
            registry=registry,
        )
        self.accepted_per_position = Counter(
            "pipespec:spec_decode_num_accepted_tokens_per_pos",
            "Verification steps that accepted the draft token at this position (from 0).",
            (*PAIR, "position"),
            registry=registry,
        )
        self.stage_counts = {  # StageStats field -> its counter, per stage (pipespec.engine.outcome_cache, relay_above)
            "predraft_hits": Counter(
                "pipespec:predraft_hits", "Verdicts a pre-drafted branch foresaw.", ("stage",), registry=registry
            ),
            "predraft_misses": Counter(
                "pipespec:predraft_misses",
                "Verdicts that changed a pre-drafting stage's tokens unforeseen.",
                ("stage",),
                registry=registry,
            ),
            "predraft_tokens": Counter(
                "pipespec:predraft_tokens", "Draft tokens sent from pre-drafted branches.", ("stage",), registry=registry
            ),
            "predraft_forwards": Counter(
                "pipespec:predraft_forwards", "Forwards that grew pre-drafted branches.", ("stage",), registry=registry
            ),
            "relayed_drafts": Counter(
                "pipespec:relayed_drafts", "Drafts a middle stage passed on unchecked, under load.", ("stage",), registry=registry
            ),
        }
        self.running = Gauge("pipespec:num_requests_running", "Requests streaming tokens now.", registry=registry)
        self.waiting = Gauge(
            "pipespec:num_requests_waiting",
            "Requests in flight with no token streamed yet (waiting to be opened, or in their prefill).",
            registry=registry,
        )
        self.kv_use = Gauge(
            "pipespec:kv_cache_usage_perc",
            "Share of a stage's KV budget its requests held when it last finished one.",
            ("stage",),
            registry=registry,
        )
        self.finished = Counter(
            "pipespec:request_success", "Finished requests, by finish reason.", ("finished_reason",), registry=registry
        )
        self.prompt_tokens = Counter("pipespec:prompt_tokens", "Prompt tokens of the requests run.", registry=registry)
        self.generation_tokens = Counter("pipespec:generation_tokens", "Tokens streamed to clients.", registry=registry)
        self.ttft = Histogram(
            "pipespec:time_to_first_token_seconds",
            "From arrival at the front door to the first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "pipespec:inter_token_latency_seconds",
            "Between successive deltas carrying tokens.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pipespec:e2e_request_latency_seconds",
            "From arrival at the front door to the finish.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        for pair in pairs:
            for counter in (self.drafts, self.draft_tokens, self.accepted_tokens, self.nodes):
                counter.labels(*pair)

    def request(self, prompt_tokens: int, arrived: float) -> RequestMetrics:
        """Start recording one request that arrived at `arrived` (time.perf_counter())."""
        self.waiting.inc()
        self.prompt_tokens.inc(prompt_tokens)
        return RequestMetrics(self, arrived)

    def record_pairs(self, pairs: Sequence[PairStats]) -> None:
        for pair in pairs:
            labels = (pair.drafter, pair.verifier)
            self.drafts.labels(*labels).inc(pair.num_drafts)
            self.draft_tokens.labels(*labels).inc(pair.num_draft_tokens)
            self.accepted_tokens.labels(*labels).inc(pair.num_accepted_tokens)
            self.nodes.labels(*labels).inc(pair.num_nodes)
            for position, count in enumerate(pair.accepted_per_position):
                self.accepted_per_position.labels(*labels, str(position)).inc(count)

    def record_stages(self, stages: Sequence[StageStats]) -> None:
        for stage in stages:
            self.kv_use.labels(stage.stage).set(stage.kv_use)
            for name, counter in self.stage_counts.items():
                if value := getattr(stage, name):
                    counter.labels(stage.stage).inc(value)

    def exposition(self) -> bytes:
        """Every metric in Prometheus's text format (`content_type`)."""
        return generate_latest(self.registry)


class RequestMetrics:
    """One request's timings as its deltas stream."""

    def __init__(self, metrics: Metrics, arrived: float):
        self.metrics = metrics
        self.arrived = arrived
        self.last_token: float | None = None
        self.finish_reason: str | None = None
        self.closed = False

    def observe(self, delta: Delta) -> None:
        now = time.perf_counter()
        m = self.metrics
        if delta.token_ids:
            m.generation_tokens.inc(len(delta.token_ids))
            if self.last_token is None:
                m.ttft.observe(now - self.arrived)
                if not self.closed:
                    m.waiting.dec()
                    m.running.inc()
            else:
                m.itl.observe(now - self.last_token)
            self.last_token = now
        if delta.finish_reason is not None and self.finish_reason is None:
            self._finish(delta.finish_reason, now)
            if delta.stats is not None:
                m.record_pairs(delta.stats.pairs)
                m.record_stages(delta.stats.stages)

    def close(self) -> None:
        """The stream ended; a request not finished by then was aborted (its client left)."""
        if self.closed:
            return
        self.closed = True
        if self.finish_reason is None:
            self._finish("abort", time.perf_counter())
        (self.metrics.waiting if self.last_token is None else self.metrics.running).dec()

    def _finish(self, reason: str, now: float) -> None:
        self.finish_reason = reason
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(now - self.arrived)
