"""Tests for pipespec/choice.py `decide`: greedy and coupled verification accept the longest matching
prefix of the drafts plus the stage's own token; coupled choices depend only on (seed, position) and
sample softmax(logits); rejection sampling (Leviathan et al.) emits tokens distributed as the
target's p whatever the drafter's q, checked statistically in the style of vLLM's rejection-sampler
test, together with a broken residual that the same check must catch."""

import math

import pytest
import torch

from pipespec import choice
from pipespec.choice import decide, rejection_streams
from pipespec.params import SamplingParams, VerifyMode
from pipespec.sampling import log_processed

GREEDY = SamplingParams()
COUPLED = SamplingParams(temperature=1.0, verify=VerifyMode.COUPLED)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Thousands of tiny decide() calls: a second intra-op thread only adds contention (on a busy
    2-core machine it made the statistical tests 20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rejection(seed=0, **kwargs):
    return SamplingParams(temperature=1.0, seed=seed, verify=VerifyMode.REJECTION, **kwargs)


def logits_with_argmax(argmaxes, vocab=6):
    """Logits rows [len(argmaxes), vocab] whose argmax is the given token in each row."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    for row, token in enumerate(argmaxes):
        logits[row, token] = 10.0
    return logits


def total_variation(counts, probs):
    freq = counts.double() / counts.sum()
    return 0.5 * float((freq - probs.double()).abs().sum())


# --- greedy -------------------------------------------------------------------------------------

ROWS = [3, 1, 4, 0]  # the greedy token at positions start, start+1, start+2, start+3


@pytest.mark.parametrize(
    "drafts, accepted, tokens",
    [
        ([3, 1, 2], 2, (3, 1, 4)),  # two match, then the correction 4
        ([0, 1, 4], 0, (3,)),  # the first differs: only the correction
        ([3, 5, 4], 1, (3, 1)),  # a later match after a mismatch does not count
        ([3, 1, 4], 3, (3, 1, 4, 0)),  # all accepted, plus the bonus token
    ],
)
def test_greedy_accepts_longest_matching_prefix_plus_own_token(drafts, accepted, tokens):
    decision = decide(logits_with_argmax(ROWS), drafts, None, GREEDY, start=10, depth=0)
    assert decision.accepted == accepted
    assert decision.tokens == tokens
    assert decision.probs is None


def test_greedy_without_drafts_returns_the_argmax():
    decision = decide(logits_with_argmax([5]), [], None, GREEDY, start=0, depth=2)
    assert (decision.accepted, decision.tokens, decision.probs) == (0, (5,), None)


def test_greedy_ignores_the_verify_mode():
    params = SamplingParams(temperature=0.0, verify=VerifyMode.REJECTION)
    decision = decide(logits_with_argmax(ROWS), [3, 1, 2], None, params, start=0, depth=0)
    assert (decision.accepted, decision.tokens, decision.probs) == (2, (3, 1, 4), None)


def test_logits_rows_must_be_one_more_than_drafts():
    with pytest.raises(AssertionError):
        decide(logits_with_argmax(ROWS), [3], None, GREEDY, start=0, depth=0)


# --- coupled ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_coupled_choice_is_the_same_with_or_without_drafts(seed):
    params = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    start = 100 + seed
    alone = [decide(logits[i : i + 1], [], None, params, start=start + i, depth=0).tokens[0] for i in range(4)]

    everything_right = decide(logits, alone[:3], None, params, start=start, depth=1)
    assert everything_right.accepted == 3
    assert list(everything_right.tokens) == alone

    wrong_second = [alone[0], (alone[1] + 1) % 8, alone[2]]
    decision = decide(logits, wrong_second, None, params, start=start, depth=0)
    assert decision.accepted == 1
    assert decision.tokens == (alone[0], alone[1])  # the correction is the stage's own choice there


def test_coupled_choice_frequencies_match_softmax():
    # Seeds and positions both vary; 10000 samples on 4 tokens: E[TV] <= 0.5 * sqrt(4 / 10000) = 0.01
    # and TV exceeds its mean by more than sqrt(ln(1/delta) / (2N)) = 0.015 with probability
    # delta < 1e-2 (the test is deterministic: this is the chance that the fixed seeds are unlucky).
    logits = torch.tensor([[1.2, 0.3, -0.5, 0.0]])
    counts = torch.zeros(4, dtype=torch.int64)
    for trial in range(10_000):
        params = SamplingParams(temperature=1.0, seed=trial)
        counts[decide(logits, [], None, params, start=trial % 13, depth=0).tokens[0]] += 1
    assert total_variation(counts, torch.softmax(logits[0].double(), dim=-1)) < 0.025


def test_coupled_choice_changes_with_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: the choice is the argmax of the noise alone
    tokens = {decide(logits, [], None, SamplingParams(temperature=1.0, seed=s), start=0, depth=0).tokens[0] for s in range(20)}
    tokens |= {decide(logits, [], None, COUPLED, start=p, depth=0).tokens[0] for p in range(20)}
    assert len(tokens) > 30


# --- rejection ----------------------------------------------------------------------------------

TRIALS = 10_000
# With N = 10000 trials on K = 4 tokens, E[TV] <= 0.5 * sqrt(K / N) = 0.01, and by McDiarmid (one
# trial moves TV by at most 1/N) TV > E[TV] + sqrt(ln(1/delta) / (2N)) has probability < delta; with
# delta = 1e-4 that is 0.01 + 0.0215 < 0.035. A correct sampler passes TV < 0.035 with probability
# > 0.9999 over the (fixed) seeds; the broken residual below is off by more than 0.1.
TV_OK = 0.035
TV_BROKEN = 0.05


def first_token_tv(p, q, trials=TRIALS, **params):
    """TV between the first token emitted by rejection verification of one q-sampled draft, and the
    target's processed distribution p' (from logits log p)."""
    logits = torch.log(torch.tensor([p, p], dtype=torch.float64))  # rows for the draft and the bonus
    q = torch.tensor(q, dtype=torch.float64)
    drafts = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(1234)).tolist()
    counts = torch.zeros(len(p), dtype=torch.int64)
    for trial, x in enumerate(drafts):
        decision = decide(logits, [x], q[None], rejection(seed=trial, **params), start=7, depth=0)
        counts[decision.tokens[0]] += 1
    target = torch.exp(log_processed(logits[:1], rejection(**params)))[0]
    return total_variation(counts, target)


PAIRS = {
    "q equals p": ([0.5, 0.25, 0.15, 0.10], [0.5, 0.25, 0.15, 0.10]),
    "q uniform": ([0.6, 0.25, 0.10, 0.05], [0.25, 0.25, 0.25, 0.25]),
    "q far from p, zero on p's mode": ([0.7, 0.1, 0.1, 0.1], [0.0, 0.05, 0.1, 0.85]),
}


@pytest.mark.parametrize("p, q", PAIRS.values(), ids=PAIRS.keys())
def test_rejection_first_token_is_distributed_as_p(p, q):
    assert first_token_tv(p, q) < TV_OK


def test_rejection_with_top_k_never_emits_removed_tokens():
    # top_k = 3 removes token 3 from p', but q drafts it most of the time.
    p, q = [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]
    assert first_token_tv(p, q, trials=4000, top_k=3) < 0.05  # 4000 trials: 0.016 + 0.034


def test_broken_residual_fails_the_same_check(monkeypatch):
    monkeypatch.setattr(choice, "residual", lambda p, q: p)  # forgets to remove q's mass
    p, q = PAIRS["q far from p, zero on p's mode"]
    assert first_token_tv(p, q) > TV_BROKEN


@pytest.mark.parametrize("seed", range(8))
def test_rejection_probs_are_the_processed_distribution_of_emitted_positions(seed):
    params = rejection(seed=seed, top_k=3)
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    q = torch.softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(100 + seed)), dim=-1).double()
    drafts = torch.argmax(q, dim=-1).tolist()
    decision = decide(logits, drafts, q, params, start=3, depth=1)

    n = decision.accepted + 1
    assert decision.tokens[: decision.accepted] == tuple(drafts[: decision.accepted])
    assert len(decision.tokens) == n
    assert decision.probs.shape == (n, 6)
    torch.testing.assert_close(decision.probs, torch.exp(log_processed(logits[:n], params)))
    assert decision.probs[torch.arange(n), list(decision.tokens)].gt(0).all()  # never a removed token


def test_rejection_without_drafts_samples_one_token():
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(0))
    decision = decide(logits, [], None, rejection(seed=3), start=0, depth=0)
    assert decision.accepted == 0 and len(decision.tokens) == 1
    torch.testing.assert_close(decision.probs, torch.softmax(logits.double(), dim=-1))


def test_rejection_accepts_a_draft_that_p_prefers():
    # p(x) >= q(x): min(1, p/q) = 1, so the draft is always accepted whatever the noise.
    logits = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 2))
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    assert all(decide(logits, [0], q, rejection(seed=s), start=0, depth=0).accepted == 1 for s in range(50))


def test_rejection_streams_are_distinct_across_depths():
    streams = [s for depth in range(5) for s in rejection_streams(depth)]
    assert len(set(streams)) == len(streams)
    assert 0 not in streams  # stream 0 is the coupled stream


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    torch.testing.assert_close(choice.residual(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    assert math.isclose(float(choice.residual(q, p).sum()), 1.0)
    torch.testing.assert_close(choice.residual(p, p), p)  # nothing left: fall back to p
