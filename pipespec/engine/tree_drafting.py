"""How a drafter grows a draft tree: EAGLE-2's dynamic tree under a node budget, grown best first.

A node's value is the sum of the drafter's log-probabilities along its path (EAGLE-2's: how likely the target is
to accept the path, when the drafter's probabilities are calibrated). The tree takes, one node at a time, the
best on offer: a child of a node already in it (each node offers its `branching` likeliest children), at most
`depth` levels down, until it holds `budget` nodes. So it holds the `budget` best nodes that a top-`branching`
search can reach, the tree EAGLE-2's reranking keeps. A node's children are known once the drafter has run a
forward of it; as none can be worth more than their parent, a node is expanded only once its own value is the
best on offer (a node the budget never reaches costs no forward).

What a node's children and values are, per sampling mode:
- greedy: the top logits; value: log-softmax.
- coupled: the top of the drafter's choice scores at the children's position (log q' plus the position's
  shared Gumbel noise, pipespec.engine.choice: the first child is the drafter's own choice); value: the
  log-softmax of those scores, how sure the drafter is of its choice once the noise is known.
- rejection: a Gumbel-top-k of q' (a sample without replacement, its noise keyed by the node), value log q'.
  Taking children by their own value would take a child for being likely, and the verifier would no longer
  see a sample of q (pipespec.engine.tree_verification). So every child is taken by what its rank is worth,
  the value of its parent's r-th likeliest token, known before it is drawn: the same as its own in greedy and
  coupled drafting (children in order of value), none of its own under rejection.

`temperature` calibrates the values (the drafter's log-probabilities divided by it first): a drafter sure of
itself too seldom (the demo's tiny drafter: its likeliest token is the target's more often than it says)
grows too wide a tree. `fit_temperature` finds it from the target's tokens (`pipespec plan`'s profile).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from itertools import count

import torch

from pipespec.engine import noise
from pipespec.engine.choice import scores
from pipespec.engine.draft_tree import ROOT, DraftTree
from pipespec.engine.sampling import log_processed
from pipespec.engine.stage import Session
from pipespec.protocol.messages import Siblings
from pipespec.protocol.params import SamplingParams
from pipespec.protocol.tree_shape import TreeShape

# (the tree so far, the nodes to feed: their ancestors fed before or with them) -> their logits [m, V]
Expand = Callable[[DraftTree, Sequence[int]], torch.Tensor]


def fit_temperature(logits: torch.Tensor, tokens: Sequence[int]) -> float:
    """The temperature that calibrates a drafter's probabilities against its target's tokens: the one of least
    negative log-likelihood of `tokens` under softmax(logits / T) (temperature scaling, Guo et al. 2017), on a grid
    from 0.3 to 2. logits [n, V]: the drafter's at the positions of the target's n tokens."""
    picked = torch.as_tensor(list(tokens))
    rows = logits.double()
    grid = [round(0.3 + 0.05 * i, 2) for i in range(35)]
    loss = [float(-torch.log_softmax(rows / t, dim=-1)[torch.arange(len(picked)), picked].mean()) for t in grid]
    return grid[loss.index(min(loss))]


def grow(
    root: torch.Tensor, expand: Expand, shape: TreeShape, params: SamplingParams, start: int, depth: int, most: int
) -> DraftTree:
    """root [V]: the drafter's logits at position `start` (after the root token); `depth`: the drafter's hops
    above the target; `most`: the deepest a node may go (the tokens the request has left). -> the tree."""
    levels = min(shape.depth, most)
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[torch.Tensor | None] = []
    value, level = {ROOT: 0.0}, {ROOT: 0}
    heap: list[tuple] = []  # (key, order, parent, token, value, q): a child of `parent`, or (token None) expand `parent`
    order = count()

    def expanded(node: int, logits: torch.Tensor) -> None:
        kids, logv, q = _children(logits, node, shape, params, start + level[node], depth)
        ranked = torch.topk(logv, len(kids)).values  # what its r-th likeliest token is worth
        for rank, x in enumerate(kids):  # taken by what its rank is worth (its own worth, but under rejection)
            heapq.heappush(
                heap, ((-(value[node] + float(ranked[rank])), 0), next(order), node, x, value[node] + float(logv[x]), q)
            )

    expanded(ROOT, root)
    while heap and len(tokens) < shape.budget:
        _, _, parent, x, v, q = heapq.heappop(heap)
        if x is None:  # a node whose children may now be worth taking: one forward of the drafter
            expanded(parent, expand(DraftTree(tuple(tokens), tuple(parents)), [parent])[0])
            continue
        node = len(tokens)
        tokens.append(x)
        parents.append(parent)
        probs.append(q)
        value[node], level[node] = v, level[parent] + 1
        if level[node] < levels:  # its children are worth at most its value: expanded once that is the best on offer
            heapq.heappush(heap, ((-v, -1), next(order), node, None, v, None))
    return DraftTree(tuple(tokens), tuple(parents), torch.stack(probs) if params.rejection and probs else None)


class LineExpander:
    """A drafter's `Expand` on any session (pipespec.engine.stage.Session): a node's logits by feeding its path as
    the session's line after the root. The session keeps the path it fed last, so a node under the last one
    expanded costs one token, one on another branch its path past where the two part; a forward a node."""

    def __init__(self, session: Session, at: int):
        """`at`: the context entries the session holds, the tree's root the last."""
        self.session = session
        self.at = at
        self.line: tuple[int, ...] = ()  # the tokens after the root the session holds

    def __call__(self, tree: DraftTree, nodes: Sequence[int]) -> torch.Tensor:
        rows = []
        for node in nodes:
            path = tuple(tree.tokens[n] for n in tree.path(node))
            same = self.kept(path)
            rows.append(self.session.forward(self.at + same, path[same:])[-1])
            self.line = path
        return torch.stack(rows)  # [len(nodes), V]

    def kept(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (after the root) the session holds: the common start of its line and them."""
        same = 0
        while same < min(len(self.line), len(tokens)) and self.line[same] == tokens[same]:
            same += 1
        return same


def _children(
    logits: torch.Tensor, node: int, shape: TreeShape, params: SamplingParams, at: int, depth: int
) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
    """logits [V] of `node`, whose children sit at position `at` -> (its `branching` children, the log-probabilities
    of their values [V], the q' they were drawn from [V] float64 under rejection, else None)."""
    row, k = logits[None], shape.branching  # [1, V]
    if not params.rejection:
        logv = values(row, params, at, shape.temperature)[0]
        return torch.topk(logv, k).indices.tolist(), logv, None
    logq = log_processed(row, params)[0]  # [V] float64
    g = noise.gumbel(params.seed, at, logq.shape[-1], node_stream(depth, node), logq.device)
    kids = [x for x in torch.topk(logq + g, k).indices.tolist() if logq[x] > float("-inf")]
    return kids, torch.log_softmax(logq / shape.temperature, dim=-1), torch.exp(logq)


def values(rows: torch.Tensor, params: SamplingParams, start: int, temperature: float) -> torch.Tensor:
    """rows [n, V] of logits at positions start.. -> [n, V]: what each token there is worth as a node, greedy or
    coupled: the log-softmax of the choice scores (pipespec.engine.choice), calibrated by `temperature`."""
    return torch.log_softmax(scores(rows, params, start).float() / temperature, dim=-1)


def siblings(
    rows: torch.Tensor, tokens: Sequence[int], params: SamplingParams, start: int, shape: TreeShape
) -> tuple[Siblings, ...]:
    """rows [n, V] of a drafter's logits at positions start.., where it chose `tokens` (n of them) -> per token, its
    value and its `branching - 1` likeliest others with theirs: a line of drafts with siblings, a tree a verifier
    can check (greedy and coupled)."""
    logv = values(rows, params, start, shape.temperature)  # [n, V]
    top = torch.topk(logv, min(shape.branching, logv.shape[-1]), dim=-1)
    out = []
    for i, token in enumerate(tokens):
        others = [(t, v) for t, v in zip(top.indices[i].tolist(), top.values[i].tolist()) if t != token][: shape.branching - 1]
        out.append(Siblings(float(logv[i, token]), tuple(t for t, _ in others), tuple(v for _, v in others)))
    return tuple(out)


def line_tree(drafts: Sequence[int], offered: Sequence[Siblings | None], room: int) -> DraftTree:
    """A verifier's tree of its drafter's line of `drafts` and the siblings offered beside them: the line (nodes
    0 .. n - 1), then the `room` siblings of best value (a sibling's: the line's before it, then its own), each a
    leaf under the draft before its own."""
    before, candidates = 0.0, []
    for i, sib in enumerate(offered):
        if sib is not None:
            candidates += [(before + v, i, t) for t, v in zip(sib.tokens, sib.values)]
            before += sib.value
    best = sorted(candidates, key=lambda c: -c[0])[:room]
    tokens = tuple(drafts) + tuple(t for _, _, t in best)
    parents = tuple(range(-1, len(drafts) - 1)) + tuple(i - 1 for _, i, _ in best)
    return DraftTree(tokens, parents)


def node_stream(depth: int, node: int) -> int:
    """The noise stream of the children a drafter `depth` hops above the target draws for `node` under rejection
    sampling: one per node, so the sibling subtrees of a tree are independent samples (as Traversal Verification
    needs); far from the chain's streams (pipespec.engine.choice.rejection_streams)."""
    return 1_000_000 + 10_000 * depth + node + 1
