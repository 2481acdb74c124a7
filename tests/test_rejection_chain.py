"""Rejection sampling through whole chains: the output distribution is the target's.

Small-vocabulary mock stages (4 tokens, independent random distributions, so drafts are often
rejected) run as a k = 2 and a k = 3 pipeline with `verify: rejection`. We draw N answers of 3
tokens with seeds 0..N-1 and compare their empirical joint distribution over the K = 64 outcomes
with the target's exact one, computed from the mock target's logits.

Bound: E[L1(empirical, p)] <= sqrt(K / N) (Cauchy-Schwarz), and one sample moves L1 by at most 2/N,
so by McDiarmid P(L1 >= sqrt(K / N) + t) <= exp(-N t^2 / 2). With delta = 1e-6 the test flakes once in
a million runs; TV = L1 / 2. The same test must catch a deliberately broken variant that samples
the full target distribution after a rejection instead of the residual (the known 3-level bug).

N = 3000 keeps the suite within its budget: the bound holds for any N, and the broken variant's TV
(0.173 at k = 2 measured at N = 3000; 0.18 at k = 2 and 0.15 at k = 3 at N = 4000) stays well over it
(0.121), where the correct chains measure 0.040 (k = 2) and 0.041 (k = 3). The broken variant runs at
k = 2 only: the residual is each stage's own step, and k = 2 shows the test's power. A k = 3 chain whose middle
stage relays under load (`relay_above`) passes its drafter's drafts on with the drafter's probabilities: it is
tested the same way, and one that relays them with other probabilities must fail (TV 0.337 measured).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

import pipespec.engine.choice
from pipespec import LocalPipeline, load_config
from pipespec.stages.mock import MockStage

V, N, NEW, PROMPT = 4, 3000, 3, (1, 2)
DELTA = 1e-6


def chain_config(k, relay_above=None):
    stages = [
        {"name": f"m{i}", "kind": "mock", "agreement": 0.0, "vocab_size": V, "scale": 1.5, "max_lookahead": 3} for i in range(k)
    ]
    stages[-1]["latency_ms"] = 0.3  # a slightly slower target: drafts are usually waiting to be verified
    if relay_above is not None:
        stages[1]["relay_above"] = relay_above
    return load_config({"stages": stages, "sampling": {"temperature": 1.0, "verify": "rejection"}})


def exact_distribution(config) -> dict[tuple[int, ...], float]:
    target = MockStage(config.stages[-1])
    probs = {}
    for seq in itertools.product(range(V), repeat=NEW):
        ctx, p = list(PROMPT), 1.0
        for x in seq:
            row = target.row(ctx[-2], ctx[-1], len(ctx))
            p *= float(torch.softmax(row.double(), -1)[x])
            ctx.append(x)
        probs[seq] = p
    return probs


def empirical_tv(config, relayed: list[int] | None = None) -> float:
    """TV of N answers against the target's distribution; `relayed`, if given, gets the drafts relayed on the way."""
    with LocalPipeline(config) as p:
        counts: Counter = Counter()
        for chunk in range(0, N, 500):  # N a multiple of 500
            futures = [p.submit(prompt_token_ids=PROMPT, max_new_tokens=NEW, seed=s) for s in range(chunk, chunk + 500)]
            counts.update(tuple(f.result().token_ids) for f in futures)
            if relayed is not None:
                relayed.append(sum(s.relayed_drafts for f in futures for s in f.result().stats.stages))
    exact = exact_distribution(config)
    return 0.5 * sum(abs(counts[seq] / N - p) for seq, p in exact.items())


def tv_bound() -> float:
    k = V**NEW
    return 0.5 * (math.sqrt(k / N) + math.sqrt(2 * math.log(1 / DELTA) / N))


@pytest.mark.slow
@pytest.mark.parametrize("k, relay_above", [(2, None), (3, None), (3, 250)], ids=["k2", "k3", "k3-relay"])
def test_rejection_chain_matches_target_distribution(k, relay_above):
    """k3-relay: the middle stage passes its drafter's drafts and their probabilities on unchecked while over 250
    of each 500 are open, and checks them for the rest."""
    relayed: list[int] = []
    tv = empirical_tv(chain_config(k, relay_above), relayed)
    assert tv < tv_bound(), f"k={k}: TV {tv:.4f} >= bound {tv_bound():.4f}"
    assert (sum(relayed) > 0) is (relay_above is not None)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2])
def test_broken_residual_is_caught(k, monkeypatch):
    monkeypatch.setattr(pipespec.engine.choice, "residual", lambda p, q: p)  # full p after a rejection: wrong
    tv = empirical_tv(chain_config(k))
    assert tv > tv_bound(), f"k={k}: the broken sampler went unnoticed (TV {tv:.4f} < {tv_bound():.4f})"


@pytest.mark.slow
def test_a_relay_passing_on_the_wrong_probabilities_is_caught(monkeypatch):
    """A middle stage that relays its drafter's drafts with uniform probabilities in place of the drafter's (those it
    relays only: the drafts it checks itself keep theirs)."""
    from pipespec.engine.request_protocol import RequestProtocol

    relay = RequestProtocol._relay

    def broken(self):
        n = max(0, min(len(self.req.up.pending), self._limit() - len(self.req.tokens)))  # what `relay` passes on
        probs = self.req.up.pending_probs
        probs[:n] = [torch.full_like(q, 1.0 / q.numel()) for q in probs[:n]]
        relay(self)

    monkeypatch.setattr(RequestProtocol, "_relay", broken)
    tv = empirical_tv(chain_config(3, relay_above=250))
    assert tv > tv_bound(), f"the broken relay went unnoticed (TV {tv:.4f} < {tv_bound():.4f})"
