"""The processed distribution p' every stage samples from, and the logprobs the target reports under it.

`log_processed` turns a stage's raw logits into log p' (temperature, then top-k, then top-p), the
distribution that coupled choices take a Gumbel-max sample of and that rejection sampling ships
downstream as q.

`token_logprobs` is what a request that asks for logprobs gets for each generated token, computed by
the target alone from its own logits at the token's position (so whatever the drafters proposed):

- sampling (temperature > 0): log p'(token), p' = `log_processed`, the distribution the token is
  drawn from (-inf for a token top-k / top-p removed, which is never the chosen one);
- greedy (temperature 0): the log-softmax of the raw logits, in float64 (top-k and top-p do not apply).

With it, the k most likely tokens under the same distribution, most likely first, ties to the lower id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec.protocol.logprobs import TokenLogprobs
from pipespec.protocol.params import SamplingParams


def log_processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> log p' [n, V] float64, -inf where top-k / top-p removed a token."""
    x = logits.to(torch.float64) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams, k: int) -> tuple[TokenLogprobs, ...]:
    """logits [n, V] at the positions of the n `tokens` -> each token's logprob and its k top alternatives
    (see the module doc), as Python floats."""
    if k < 0:
        raise ValueError(f"logprobs must be >= 0 (top alternatives per token), got {k}")
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1) if params.greedy else log_processed(logits, params)  # [n, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()  # [n]
    if k:
        top_logp, top_ids = torch.sort(logp, dim=-1, descending=True, stable=True)  # stable: ties to the lower id
        top_logp, top_ids = top_logp[:, :k].tolist(), top_ids[:, :k].tolist()  # [n, k]
    else:
        top_logp = top_ids = [[] for _ in tokens]
    return tuple(
        TokenLogprobs(int(t), lp, tuple(ti), tuple(tl)) for t, lp, ti, tl in zip(tokens, chosen, top_ids, top_logp, strict=True)
    )
