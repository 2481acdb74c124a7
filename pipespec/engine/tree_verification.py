"""How a verifier decides on a draft tree: the path it accepts and its own token after it.

`verify_tree` is the tree's `decide` (pipespec.engine.choice): given the verifier's logits for the root and every
node (rows [n + 1, V]: row 0 at position `start`, row i + 1 node i's, at `start + depth_i`), it returns the
accepted path and the verifier's token after it. The output is distributed as the verifier's own sampling,
whatever the tree:

- greedy and coupled: exact match. The verifier's choice at the root picks the child that carries it, and so
  on down; the first position where no child carries its choice gets that choice. The choices are those of
  a one-token decode (the coupled noise is keyed by position), so the answer is the target alone's.
- rejection, `TOKEN` (SpecInfer's recursive rejection, without replacement, as the children were drafted):
  from the root down, each child x in turn is accepted with probability min(1, p(x) / q(x)); a rejected one
  turns p into norm(max(0, p - q)) and takes x out of q; with every child rejected (or none), the verifier
  samples p. On a chain it is `decide`, noise for noise.
- rejection, `TRAVERSAL` (Traversal Verification, Weng et al., arXiv 2505.12398): from the leaves up. Each
  node holds p_a, the probability that its path is accepted as a whole, min(1, p_a(parent) p(x) / q(x)); the
  first leaf in post-order is accepted with probability p_a (with its path) or deleted, and then its parent
  takes the rejected mass out: with r = p_a(parent) p(.|parent), p(.|parent) becomes norm(max(0, r - q)),
  p_a(parent) becomes sum max(0, r - q) / sum max(0, q - r), and q loses the deleted token. A node whose
  children are all deleted is a leaf in its turn; the root is accepted last, always. After the accepted
  path the verifier samples its node's p (as it stands then). It accepts at least what `TOKEN` does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pipespec.engine import noise
from pipespec.engine.choice import rejection_streams, residual, sample
from pipespec.engine.draft_tree import ROOT, DraftTree
from pipespec.engine.sampling import log_processed
from pipespec.protocol.params import SamplingParams


class TreeVerify(str, enum.Enum):
    """How a verifier checks a tree under rejection sampling (greedy and coupled: exact match)."""

    TOKEN = "token"  # SpecInfer's recursive rejection, node by node from the root
    TRAVERSAL = "traversal"  # Traversal Verification, whole paths from the leaves


@dataclass(frozen=True)
class TreeDecision:
    path: tuple[int, ...]  # the accepted nodes, the root's child first
    tokens: tuple[int, ...]  # their tokens, then this stage's own token after them

    @property
    def accepted(self) -> int:
        return len(self.path)

    def on_path(self, rows: torch.Tensor, root: int = 0) -> torch.Tensor:
        """rows [root + 1 + nodes, ...] whose row `root` is the tree's root and the rows after it its nodes' -> the rows
        up to the root, then the path's nodes' [root + 1 + accepted, ...] (logits of the tokens decided, hidden states
        of what is kept)."""
        index = [*range(root + 1), *(root + 1 + node for node in self.path)]
        return rows[torch.tensor(index, dtype=torch.long, device=rows.device)]


def verify_tree(
    logits: torch.Tensor,  # [n + 1, V]: the root's row, then each node's
    tree: DraftTree,
    params: SamplingParams,
    start: int,  # position of the token the root's row decides
    depth: int = 0,  # hops from this stage to the target (target = 0)
    method: TreeVerify = TreeVerify.TRAVERSAL,
) -> TreeDecision:
    if logits.shape[0] != len(tree) + 1:
        raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} rows of logits, got {logits.shape[0]}")
    if not params.rejection:
        return _exact(logits, tree, params, start)
    if tree.probs is None and len(tree):
        raise ValueError("rejection sampling needs the drafter's q for each node of a tree")
    p = torch.exp(log_processed(logits, params))  # [n + 1, V] float64
    if method is TreeVerify.TOKEN:
        return _token_level(p, tree, params.seed, start, depth)
    return _traversal(p, tree, params.seed, start, depth)


def choices(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, start: int) -> list[int]:
    """The token a one-token decode chooses at the root and at every node (greedy, or coupled: its noise keyed by position)."""
    if params.greedy:
        return torch.argmax(logits.to(torch.float32), dim=-1).tolist()
    depths = torch.tensor((0,) + tree.depths)
    g = noise.gumbel_rows(params.seed, start, int(depths.max()) + 1, logits.shape[-1], 0, logits.device)  # [D + 1, V]
    return torch.argmax(log_processed(logits, params) + g[depths.to(g.device)], dim=-1).tolist()


def _exact(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, start: int) -> TreeDecision:
    chosen = choices(logits, tree, params, start)
    node, path = ROOT, []
    while True:
        token = chosen[node + 1]
        child = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if child is None:
            return TreeDecision(tuple(path), tuple(tree.tokens[i] for i in path) + (token,))
        path.append(child)
        node = child


def _token_level(p: torch.Tensor, tree: DraftTree, seed: int, start: int, depth: int) -> TreeDecision:
    s_sample, s_accept, s_residual = rejection_streams(depth)
    node, path = ROOT, []
    while True:
        at = start + tree.depth(node)
        target = p[node + 1]
        kids = tree.children(node)
        if not kids:
            return _decision(tree, path, sample(target, seed, at, s_sample))
        q = tree.probs[kids[0]].to(p.device)
        u = noise.uniform(seed, at, len(kids), s_accept)
        for i, kid in enumerate(kids):
            x = tree.tokens[kid]
            if float(u[i]) * float(q[x]) < float(target[x]):  # accepted with probability min(1, p(x) / q(x))
                path.append(kid)
                node = kid
                break
            target, q = residual(target, q), _without(q, x)
        else:
            return _decision(tree, path, sample(target, seed, at, s_residual))


def _traversal(p: torch.Tensor, tree: DraftTree, seed: int, start: int, depth: int) -> TreeDecision:
    s_sample, s_accept, s_residual = rejection_streams(depth)
    target = {node: p[node + 1] for node in range(ROOT, len(tree))}  # p(. | node), its mass taken out as children go
    drafted = {node: tree.probs[kids[0]].to(p.device) for node in range(ROOT, len(tree)) if (kids := tree.children(node))}
    alive = {node: list(tree.children(node)) for node in range(ROOT, len(tree))}
    accept = {ROOT: 1.0}  # p_a: the probability its path is accepted as a whole

    def update(node: int) -> None:
        """p_a of `node`'s living descendants, from its own."""
        for kid in alive[node]:
            x = tree.tokens[kid]
            q = float(drafted[node][x])
            accept[kid] = min(1.0, accept[node] * float(target[node][x]) / q) if q > 0 else 0.0
            update(kid)

    update(ROOT)
    etas = noise.uniform(seed, start, len(tree) + 1, s_accept)  # one per leaf tried, at most one per node
    for tried in range(len(tree) + 1):
        leaf = ROOT
        while alive[leaf]:
            leaf = alive[leaf][0]
        if leaf == ROOT or float(etas[tried]) < accept[leaf]:
            stream = s_residual if tree.children(leaf) else s_sample  # its p a residual once children went
            return _decision(tree, list(tree.path(leaf)), sample(target[leaf], seed, start + tree.depth(leaf), stream))
        parent = tree.parents[leaf]
        target[parent], accept[parent] = taken_out(target[parent], accept[parent], drafted[parent])
        drafted[parent] = _without(drafted[parent], tree.tokens[leaf])
        alive[parent].remove(leaf)
        update(parent)
    raise AssertionError("traversal verification tried more leaves than the tree has nodes")


def taken_out(p: torch.Tensor, accept: float, q: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A node's p [V] and p_a once a child drawn from q [V] is deleted with its subtree: with r = p_a p, the mass
    its paths may still be accepted with, p becomes norm(max(0, r - q)) and p_a sum max(0, r - q) / sum max(0, q - r)
    (the deleted child's rejection took sum max(0, q - r) of the draws, and r keeps what q did not cover)."""
    r = accept * p
    over, under = torch.clamp(r - q, min=0.0), torch.clamp(q - r, min=0.0)
    kept, lost = float(over.sum()), float(under.sum())
    return (over / kept if kept > 0 else p), (min(1.0, kept / lost) if lost > 0 else 1.0)


def _without(q: torch.Tensor, x: int) -> torch.Tensor:
    """q [V] with token x taken out, renormalised: the next sibling's q (drawn without replacement)."""
    q = q.clone()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def _decision(tree: DraftTree, path: list[int], token: int) -> TreeDecision:
    return TreeDecision(tuple(path), tuple(tree.tokens[i] for i in path) + (token,))
