"""Tests for pipespec/engine/choice.py `decide`: greedy and coupled verification accept the longest matching
prefix of the drafts plus the stage's own token; coupled choices depend only on (seed, position) and
sample softmax(logits); rejection sampling (Leviathan et al.) emits tokens distributed as the
target's p whatever the drafter's q, checked statistically in the style of vLLM's rejection-sampler
test, together with a broken residual that the same check must catch."""

import math

import pytest
import torch

from pipespec.engine import choice
from pipespec.engine.choice import decide, rejection_streams
from pipespec.engine.sampling import log_processed
from pipespec.protocol.params import SamplingParams, VerifyMode

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


def tv_bound(n, k=4, delta=1e-4):
    """A TV that n samples of a correct k-token sampler exceed with probability < delta.

    E[TV] <= 0.5 * sqrt(k / n), and one sample moves TV by at most 1/n, so by McDiarmid TV exceeds
    its mean by more than sqrt(ln(1/delta) / (2n)) with probability < delta. The tests are
    deterministic (fixed seeds); delta is the chance that a correct sampler's fixed seeds are unlucky.
    """
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


# 10000 trials (about 2 s each test): tv_bound(10000) = 0.0315. 20000 trials would give 0.022 but
# take twice as long. A residual that forgets to remove q's mass is off by about 0.16 (see below).
TRIALS = 10_000
TV_BROKEN = 0.05


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
    # Seeds and positions both vary.
    logits = torch.tensor([[1.2, 0.3, -0.5, 0.0]])
    counts = torch.zeros(4, dtype=torch.int64)
    for trial in range(TRIALS):
        params = SamplingParams(temperature=1.0, seed=trial)
        counts[decide(logits, [], None, params, start=trial % 13, depth=0).tokens[0]] += 1
    assert total_variation(counts, torch.softmax(logits[0].double(), dim=-1)) < tv_bound(TRIALS)


def test_coupled_choice_changes_with_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: the choice is the argmax of the noise alone
    tokens = {decide(logits, [], None, SamplingParams(temperature=1.0, seed=s), start=0, depth=0).tokens[0] for s in range(20)}
    tokens |= {decide(logits, [], None, COUPLED, start=p, depth=0).tokens[0] for p in range(20)}
    assert len(tokens) > 30


# --- rejection ----------------------------------------------------------------------------------


def rejection_trials(p, q, p_bonus, trials, **params):
    """Verify one q-sampled draft per trial against target logits log p (then log p_bonus for the bonus
    position), seed = trial. Returns (counts of the first emitted token, counts of the bonus token
    emitted after an accepted draft, the target's processed rows [2, V])."""
    logits = torch.log(torch.tensor([p, p_bonus], dtype=torch.float64))
    q = torch.tensor(q, dtype=torch.float64)
    drafts = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(1234)).tolist()
    first = torch.zeros(len(p), dtype=torch.int64)
    bonus = torch.zeros(len(p), dtype=torch.int64)
    for trial, x in enumerate(drafts):
        decision = decide(logits, [x], q[None], rejection(seed=trial, **params), start=7, depth=0)
        first[decision.tokens[0]] += 1
        if decision.accepted:
            bonus[decision.tokens[1]] += 1
    return first, bonus, torch.exp(log_processed(logits, rejection(**params)))


def first_token_tv(p, q, trials=TRIALS, **params):
    """TV between the first token emitted when verifying q-sampled drafts and the target's p'."""
    first, _, target = rejection_trials(p, q, p, trials, **params)
    return total_variation(first, target[0])


PAIRS = {
    "q uniform": ([0.6, 0.25, 0.10, 0.05], [0.25, 0.25, 0.25, 0.25]),
    "q far from p, zero on p's mode": ([0.7, 0.1, 0.1, 0.1], [0.0, 0.05, 0.1, 0.85]),
}


@pytest.mark.parametrize("p, q", PAIRS.values(), ids=PAIRS.keys())
def test_rejection_emits_tokens_distributed_as_p(p, q):
    p_bonus = p[::-1]  # another distribution at the bonus position
    first, bonus, target = rejection_trials(p, q, p_bonus, TRIALS)
    assert total_variation(first, target[0]) < tv_bound(TRIALS)
    # After an accepted draft, the bonus token is a fresh sample of the next position's p'.
    assert total_variation(bonus, target[1]) < tv_bound(int(bonus.sum()))


def test_rejection_with_top_k_never_emits_removed_tokens():
    # top_k = 3 removes token 3 from p', but q drafts it most of the time.
    p, q = [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]
    first, _, target = rejection_trials(p, q, p, 4000, top_k=3)
    assert target[0, 3] == 0 and first[3] == 0
    assert total_variation(first, target[0]) < tv_bound(4000)


def test_broken_residual_fails_the_same_check(monkeypatch):
    monkeypatch.setattr(choice, "residual", lambda p, q: p)  # forgets to remove q's mass
    p, q = PAIRS["q far from p, zero on p's mode"]
    tv = first_token_tv(p, q)
    assert tv > TV_BROKEN > tv_bound(TRIALS)  # the check that a correct sampler passes fails here


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


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        SamplingParams(temperature=0.9, seed=5, verify=VerifyMode.COUPLED),
        SamplingParams(temperature=0.9, seed=5, verify=VerifyMode.REJECTION),
    ],
    ids=["greedy", "coupled", "rejection"],
)
def test_generate_each_is_decide_on_each_line(params):
    """choice.generate_each (pre-drafted branches grown together): each row's decision is decide's, at its own position."""
    rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows[2, 7] = rows[2, 9] = rows[2].max() + 1.0  # a tie: the first index, as decide takes it
    starts = [4, 17, 9, 0, 30, 5]
    got = choice.generate_each(rows, starts, params, depth=1)
    for row, start, decision in zip(rows, starts, got):
        want = decide(row[None], (), None, params, start, 1)
        assert decision.tokens == want.tokens and decision.accepted == 0
        assert (decision.probs is None) == (want.probs is None)
        if want.probs is not None:
            assert torch.equal(decision.probs, want.probs)
