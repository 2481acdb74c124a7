"""Tests for pipespec/engine/tree_verification.py and tree_drafting.py: greedy and coupled trees take the path a
one-token decode would; under rejection sampling both token-level verification and Traversal Verification emit
the target's distribution whatever the drafter's (total variation over the first two tokens, against the exact
joint, at a fixed seed budget), each with a deliberately broken variant that the same check catches;
Traversal Verification accepts at least as much; on a chain, token-level verification is `decide`."""

from __future__ import annotations

import math

import pytest
import torch

from pipespec.engine import noise, tree_verification
from pipespec.engine.choice import decide
from pipespec.engine.draft_tree import ROOT, DraftTree
from pipespec.engine.tree_drafting import grow
from pipespec.engine.tree_verification import TreeVerify, verify_tree
from pipespec.protocol.params import SamplingParams, VerifyMode
from pipespec.protocol.tree_shape import TreeShape

V = 5
TRIALS = 6000
SHAPE = TreeShape(budget=6, depth=3, branching=2)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _logits(model: str, context: tuple[int, ...]) -> torch.Tensor:
    """A toy model's logits [V] after `context`: the drafter ("q") and the target ("p") disagree a good deal."""
    seed = sum(7919 * (i + 1) * (x + 3) for i, x in enumerate(context)) + 1000 * len(context) + (model == "q")
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * (2.0 if model == "q" else 1.5)


def _context(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[n] for n in tree.path(node))


def _step(params: SamplingParams, method: TreeVerify, shape: TreeShape = SHAPE):
    """One tree drafted by the toy drafter and verified by the toy target -> (decision, tree)."""
    expand = lambda tree, nodes: torch.stack([_logits("q", _context(tree, n)) for n in nodes])  # noqa: E731
    tree = grow(_logits("q", ()), expand, shape, params, 0, 1, 8)
    rows = torch.stack([_logits("p", ())] + [_logits("p", _context(tree, n)) for n in range(len(tree))])
    return verify_tree(rows, tree, params, 0, 0, method), tree


def _joint_tv(method: TreeVerify) -> tuple[float, float]:
    """TV of the first two tokens of TRIALS seeded steps against the target's exact joint, and the mean accepted."""
    counts = torch.zeros(V, V, dtype=torch.float64)
    accepted = 0
    for seed in range(TRIALS):
        decision, _ = _step(SamplingParams(temperature=1.0, seed=seed, verify=VerifyMode.REJECTION), method)
        accepted += decision.accepted
        first, *rest = decision.tokens
        if not rest:  # the next step's token: the target's own sample after the first
            p = torch.softmax(_logits("p", (first,)).double(), -1)
            rest = [int(torch.argmax(torch.log(p) + noise.gumbel(seed, 1, V, 99)))]
        counts[first, rest[0]] += 1
    p1 = torch.softmax(_logits("p", ()).double(), -1)
    exact = torch.stack([p1[a] * torch.softmax(_logits("p", (a,)).double(), -1) for a in range(V)])
    return 0.5 * float((counts / TRIALS - exact).abs().sum()), accepted / TRIALS


def tv_bound(n: int, k: int = V * V, delta: float = 1e-4) -> float:
    """A TV that n samples of a correct k-outcome sampler exceed with probability < delta (tests/test_choice.py)."""
    return 0.5 * math.sqrt(k / n) + math.sqrt(math.log(1 / delta) / (2 * n))


@pytest.mark.parametrize("method", list(TreeVerify))
def test_rejection_trees_emit_the_targets_distribution(method):
    tv, _ = _joint_tv(method)
    assert tv < tv_bound(TRIALS), f"{method.value}: TV {tv:.4f} >= bound {tv_bound(TRIALS):.4f}"


def test_traversal_accepts_at_least_what_token_level_does():
    (_, token), (_, traversal) = _joint_tv(TreeVerify.TOKEN), _joint_tv(TreeVerify.TRAVERSAL)
    assert traversal >= token, (traversal, token)


def test_a_token_level_residual_that_forgets_q_is_caught(monkeypatch):
    monkeypatch.setattr(tree_verification, "residual", lambda p, q: p)
    tv, _ = _joint_tv(TreeVerify.TOKEN)
    assert tv > tv_bound(TRIALS), f"the broken residual went unnoticed (TV {tv:.4f})"


def test_a_traversal_that_forgets_the_rejected_draws_is_caught(monkeypatch):
    """The mutation: p_a of a parent is the mass left, sum max(0, r - q), not divided by the draws rejected."""

    def taken_out(p, accept, q):
        over = torch.clamp(accept * p - q, min=0.0)
        kept = float(over.sum())
        return (over / kept if kept > 0 else p), min(1.0, kept)

    monkeypatch.setattr(tree_verification, "taken_out", taken_out)
    tv, _ = _joint_tv(TreeVerify.TRAVERSAL)
    assert tv > tv_bound(TRIALS), f"the broken traversal went unnoticed (TV {tv:.4f})"


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3, verify=VerifyMode.COUPLED)])
def test_greedy_and_coupled_take_the_path_of_the_verifiers_own_choices(params):
    decision, tree = _step(params, TreeVerify.TRAVERSAL)
    want = []  # a one-token decode: the verifier's choice after each token it committed
    for position in range(len(decision.tokens)):
        row = _logits("p", tuple(want))[None]
        want.append(decide(row, (), None, params, position, 0).tokens[0])
    assert list(decision.tokens) == want
    assert [tree.tokens[n] for n in decision.path] == want[:-1]


def test_token_level_on_a_chain_is_decide():
    for seed in range(40):
        params = SamplingParams(temperature=1.0, seed=seed, verify=VerifyMode.REJECTION)
        drafts = [1, 3, 0]
        q = torch.softmax(torch.stack([_logits("q", tuple(drafts[:i])) for i in range(3)]).double(), -1)
        rows = torch.stack([_logits("p", tuple(drafts[:i])) for i in range(4)])
        chain = verify_tree(rows, DraftTree.chain(drafts, q), params, 5, 0, TreeVerify.TOKEN)
        assert chain.tokens == decide(rows, drafts, q, params, 5, 0).tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.8, verify=VerifyMode.COUPLED),
        SamplingParams(temperature=0.8, verify=VerifyMode.REJECTION),
    ],
)
def test_a_grown_tree_keeps_its_budget_and_depth_and_its_parents(params):
    shape = TreeShape(budget=7, depth=4, branching=3)
    _, tree = _step(params, TreeVerify.TRAVERSAL, shape)
    assert len(tree) == 7 and max(tree.depths) <= 4
    assert all(len(tree.children(n)) <= 3 for n in (ROOT, *range(len(tree))))
    assert all(len(set(tree.tokens[c] for c in tree.children(n))) == len(tree.children(n)) for n in (ROOT, *range(len(tree))))
    assert (tree.probs is not None) == params.rejection


def test_a_tree_of_branching_one_is_the_drafters_chain():
    params = SamplingParams()
    _, tree = _step(params, TreeVerify.TRAVERSAL, TreeShape(budget=4, depth=4, branching=1))
    assert tree.parents == (ROOT, 0, 1, 2)
    chain = []
    for _ in range(4):
        chain.append(int(torch.argmax(_logits("q", tuple(chain)))))
    assert list(tree.tokens) == chain


@pytest.mark.parametrize("field", ["budget", "depth", "branching"])
def test_a_bad_tree_shape_names_its_field(field):
    with pytest.raises(ValueError, match=f"tree.{field} must be an integer >= 1, got 0"):
        TreeShape(**{field: 0})


def test_a_node_whose_parent_comes_after_it_is_refused():
    with pytest.raises(ValueError, match="node 0: its parent 1 is not the root or an earlier node"):
        DraftTree((4, 5), (1, ROOT))
