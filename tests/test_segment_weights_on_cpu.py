"""How much each tree segment counts in the loss (``algorithm.spo.tree.segment_weight``), exactly.

* The weights of hand-built trees, uneven branching and early stops included, from the plain reference
  and from the batched rows the estimator uses.
* The token advantages and trained masks of each weighting on a worked 2-2 tree.
* By exact enumeration of every tree a toy tabular policy can sample (one token a segment): the
  expected update of ``paths`` is a multiple of the true policy gradient in a tree whose leaves all
  reach the last depth, ``(1 - 1/b) b^D`` for a b-ary tree of depth D; the expected update of
  ``segment`` is the level-weighted sum ``sum_k b^k (1 - 1/b) g_k``; with branching that differs by
  level the baseline's shrink ``1 - 1/b`` differs too (a sibling-only baseline removes it), and with
  early stops leaf counts under-weight the responses that stop.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from spo_verl.core.algorithms.advantages import (
    leaf_path_counts,
    segment_weights,
    tree_node_advantages,
    tree_values,
)
from spo_verl.core.algorithms.tree_rows import tree_token_advantages
from spo_verl.core.config import SPOConfigError, parse_spo_settings

# root 0 -> a=1, b=2 (b stops early); a -> a1=3 (leaf), a2=4, a3=5 (leaf); a2 -> 6, 7.
UNEVEN_PARENTS = [-1, 0, 0, 1, 1, 1, 4, 4]
UNEVEN_PATHS = [[1, 3], [1, 4, 6], [1, 4, 7], [1, 5], [2]]  # one row per leaf, in leaf order


def test_leaf_paths_and_weights_of_an_uneven_tree():
    assert leaf_path_counts(UNEVEN_PARENTS) == [5, 4, 1, 1, 2, 1, 1, 1]
    assert segment_weights(UNEVEN_PARENTS, "segment") == [0, 1, 1, 1, 1, 1, 1, 1]
    assert segment_weights(UNEVEN_PARENTS, "paths") == [0, 4, 1, 1, 2, 1, 1, 1]
    assert segment_weights(UNEVEN_PARENTS, "sqrt_paths") == [0, 2, 1, 1, math.sqrt(2), 1, 1, 1]
    with pytest.raises(ValueError, match=r"segment_weight must be one of \['segment', 'paths', 'sqrt_paths'\], got 'leaves'"):
        segment_weights(UNEVEN_PARENTS, "leaves")


@pytest.mark.parametrize("weighting", ["segment", "paths", "sqrt_paths"])
def test_batched_weights_are_the_reference_and_each_segment_counts_its_weight(weighting):
    """The estimator's rows: node weights equal the reference's, and summed over the rows, each
    segment's trained copies carry its advantage times its weight."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    ends = [[2, 3], [2, 4, 5], [2, 4, 6], [2, 3], [1]]
    length = 6
    mask = torch.ones(len(UNEVEN_PATHS), length)
    result = tree_token_advantages(["t"] * 5, UNEVEN_PATHS, ends, rewards, mask, drop_zero_advantage=False,
                                   zero_untrained=True, segment_weight=weighting)
    # The forest numbers nodes by first appearance: root, 1, 3, 4, 6, 7, 5, 2.
    order = [0, 1, 3, 4, 6, 7, 5, 2]
    reference = segment_weights(UNEVEN_PARENTS, weighting)
    assert result.node_weights.tolist() == pytest.approx([reference[n] for n in order], rel=1e-15, abs=0)
    leaf_rewards = {3: 1.0, 6: 0.0, 7: 1.0, 5: 1.0, 2: 0.0}
    advantages = tree_node_advantages(UNEVEN_PARENTS, tree_values(UNEVEN_PARENTS, leaf_rewards))
    for node in range(1, 8):
        carried = 0.0
        for row, (path, row_ends) in enumerate(zip(UNEVEN_PATHS, ends)):
            if node in path:
                k = path.index(node)
                start = row_ends[k - 1] if k else 0
                tokens = result.token_advantages[row, start:row_ends[k]]
                trained = result.trained_mask[row, start:row_ends[k]]
                assert trained.all() or not trained.any()  # a segment's tokens go together
                carried += float(tokens[0]) if trained.all() else 0.0
        assert carried == pytest.approx(advantages[node] * reference[node], abs=1e-15), node
    # The rows that train each segment: its owner alone under segment, every row through it otherwise.
    copies = {"segment": [0, 1, 1, 1, 1, 1, 1, 1], "paths": [0, 4, 1, 2, 1, 1, 1, 1]}
    assert result.node_copies.tolist() == copies["segment" if weighting == "segment" else "paths"]


def test_worked_2_2_tree():
    """ALGORITHM.md's 2-2 tree: A -> AA (1), AB (0); B -> BA (0), BB (0). V(A) = 1/2, V(B) = 0,
    V(root) = 1/4: A(A) = +1/4, A(B) = -1/4, A(AA) = +1/2, A(AB) = -1/2, B's leaves 0 (dropped).
    ``segment`` trains A in row AA only; ``paths`` in AA and AB, each with +1/4; ``sqrt_paths`` in both
    with +1/4 / sqrt(2)."""
    paths = [[1, 3], [1, 4], [2, 5], [2, 6]]
    ends = [[2, 4], [2, 4], [2, 4], [2, 4]]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    mask = torch.ones(4, 4)
    q = 0.25
    expected = {
        "segment": [[q, q, .5, .5], [0, 0, -.5, -.5], [-q, -q, 0, 0], [0, 0, 0, 0]],
        "paths": [[q, q, .5, .5], [q, q, -.5, -.5], [-q, -q, 0, 0], [-q, -q, 0, 0]],
        "sqrt_paths": [[q / math.sqrt(2)] * 2 + [.5, .5], [q / math.sqrt(2)] * 2 + [-.5, -.5],
                       [-q / math.sqrt(2)] * 2 + [0, 0], [-q / math.sqrt(2)] * 2 + [0, 0]],
    }
    for weighting, table in expected.items():
        result = tree_token_advantages(["t"] * 4, paths, ends, rewards, mask, zero_untrained=True,
                                       segment_weight=weighting)
        assert torch.equal(result.token_advantages, torch.tensor(table, dtype=torch.float64)), weighting
        assert torch.equal(result.trained_mask, torch.tensor(table) != 0), weighting


def test_the_setting_is_parsed_and_refused_by_name():
    assert parse_spo_settings(None).tree.segment_weight == "segment"  # the paper's stays the default
    assert parse_spo_settings({"tree": {"segment_weight": "paths"}}).tree.segment_weight == "paths"
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.tree\.segment_weight.*'segment', 'paths', 'sqrt_paths'"):
        parse_spo_settings({"tree": {"segment_weight": "leaves"}})


# -- exact enumeration on a tabular policy ------------------------------------------------------------


class TabularPolicy:
    """A softmax policy with its own logits at every prefix, one token a segment. With ``stop_depths`` the
    last of the ``vocabulary`` tokens ends the response, and is only available at those depths."""

    def __init__(self, branching: tuple[int, ...], vocabulary: int, stop_depths: tuple[int, ...] = (), seed: int = 0):
        self.branching, self.vocabulary, self.stop_depths = branching, vocabulary, stop_depths
        self.states = [()]  # every prefix a token is drawn at
        for depth in range(len(branching) - 1):
            self.states += [s + (a,) for s in self.states if len(s) == depth for a in self.actions(depth)
                            if not self.stops(s + (a,))]
        self.index = {s: i for i, s in enumerate(self.states)}
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(len(self.states), vocabulary, generator=generator, dtype=torch.float64)
        self.rewards = {path: float(torch.rand((), generator=generator, dtype=torch.float64)) for path in self.paths()}

    def actions(self, depth: int) -> range:
        stop_allowed = not self.stop_depths or depth in self.stop_depths
        return range(self.vocabulary if stop_allowed else self.vocabulary - 1)

    def stops(self, prefix: tuple) -> bool:
        return bool(self.stop_depths) and prefix[-1] == self.vocabulary - 1

    def complete(self, prefix: tuple) -> bool:
        return len(prefix) == len(self.branching) or (bool(prefix) and self.stops(prefix))

    def probabilities(self, logits: torch.Tensor, state: tuple) -> torch.Tensor:
        allowed = torch.full((self.vocabulary,), -math.inf, dtype=torch.float64)
        allowed[list(self.actions(len(state)))] = 0.0
        return torch.softmax(logits[self.index[state]] + allowed, dim=-1)

    def paths(self) -> list[tuple]:
        """Every complete response: it stops, or it reaches the last depth."""
        out, frontier = [], [()]
        while frontier:
            state = frontier.pop()
            for action in self.actions(len(state)):
                (out if self.complete(state + (action,)) else frontier).append(state + (action,))
        return out

    def true_gradient(self) -> torch.Tensor:
        logits = self.logits.clone().requires_grad_(True)
        expected = sum(math.prod(self.probabilities(logits, p[:d])[a] for d, a in enumerate(p)) * r
                       for p, r in self.rewards.items())
        (gradient,) = torch.autograd.grad(expected, logits)
        return gradient

    def level_parts(self) -> list[torch.Tensor]:
        """The true gradient's part from each level's segments (the logits of its states, at depth k - 1)."""
        gradient = self.true_gradient()
        parts = []
        for depth in range(len(self.branching)):
            part = torch.zeros_like(gradient)
            rows = [self.index[s] for s in self.states if len(s) == depth]
            part[rows] = gradient[rows]
            parts.append(part)
        return parts


def sampled_trees(policy: TabularPolicy):
    """Every tree the policy can sample, with its probability: the root has ``branching[0]`` children,
    each child that did not stop ``branching[1]``, and so on. Yields (probability, parents, prefixes):
    node n's parent and its root-to-node tokens (its own last)."""

    def expand(parents, prefixes, probability, frontier):
        if not frontier:
            yield probability, parents, prefixes
            return
        node, rest = frontier[0], frontier[1:]
        prefix = prefixes[node]
        if node and policy.complete(prefix):
            yield from expand(parents, prefixes, probability, rest)
            return
        probabilities = policy.probabilities(policy.logits, prefix).tolist()
        width = policy.branching[len(prefix)]
        for choice in itertools.product(policy.actions(len(prefix)), repeat=width):
            children = list(range(len(parents), len(parents) + width))
            yield from expand(parents + [node] * width, prefixes + [prefix + (a,) for a in choice],
                              probability * math.prod(probabilities[a] for a in choice), rest + children)

    yield from expand([-1], [()], 1.0, [0])


def expected_update(policy: TabularPolicy, weighting: str, sibling_only_baseline: bool = False) -> torch.Tensor:
    """E over sampled trees of the update ``sum over trained tokens of A grad log pi(token)``, the
    estimator's maths run as the trainer runs it: every tree a tree of one forest, one row per leaf
    (``tree_token_advantages``, one token a segment). ``sibling_only_baseline`` scales each advantage
    by b / (b - 1): V(n) less the mean of its b - 1 siblings instead of all b children's."""
    tree_ids, paths, ends, rewards, weights, nodes = [], [], [], [], [], []
    for tree, (probability, parents, prefixes) in enumerate(sampled_trees(policy)):
        children = [0] * len(parents)
        for parent in parents[1:]:
            children[parent] += 1
        for leaf in (n for n in range(1, len(parents)) if not children[n]):
            path, node = [], leaf
            while node:
                path.append(node)
                node = parents[node]
            path.reverse()
            tree_ids.append(tree), paths.append(path), ends.append(list(range(1, len(path) + 1)))
            rewards.append(policy.rewards[prefixes[leaf]])
            weights.append(probability)
            nodes.append([(prefixes[n], children[parents[n]]) for n in path])
    width = len(policy.branching)
    mask = torch.tensor([[1.0] * len(p) + [0.0] * (width - len(p)) for p in paths])
    result = tree_token_advantages(tree_ids, paths, ends, torch.tensor(rewards, dtype=torch.float64), mask,
                                   drop_zero_advantage=False, zero_untrained=True, segment_weight=weighting)
    # grad log pi(a | s) = e_a - pi(. | s) at state s's logits, summed over the trained tokens at once.
    token_row, token_t = result.trained_mask.nonzero(as_tuple=True)
    coefficients, states, actions = [], [], []
    for row, t in zip(token_row.tolist(), token_t.tolist()):
        prefix, siblings = nodes[row][t]
        advantage = float(result.token_advantages[row, t])
        if sibling_only_baseline:
            advantage = advantage * siblings / (siblings - 1) if siblings > 1 else 0.0
        coefficients.append(weights[row] * advantage)
        states.append(policy.index[prefix[:-1]])
        actions.append(prefix[-1])
    policy_table = torch.stack([policy.probabilities(policy.logits, state) for state in policy.states])
    states, coefficients = torch.tensor(states), torch.tensor(coefficients, dtype=torch.float64)
    scores = torch.nn.functional.one_hot(torch.tensor(actions), policy.vocabulary).double() - policy_table[states]
    return torch.zeros_like(policy.logits).index_add_(0, states, coefficients[:, None] * scores)


def _cosine(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_paths_is_a_multiple_of_the_true_gradient_and_segment_weights_the_levels():
    """2-2-2 tree, two tokens, no early stop: 2^14 trees. E[paths] = (1 - 1/2) 2^3 grad J = 4 grad J;
    E[segment] = sum_k 2^k (1/2) g_k; E[sqrt_paths] = sum_k 2^k 2^((3 - k)/2) (1/2) g_k."""
    policy = TabularPolicy((2, 2, 2), vocabulary=2, seed=1)
    assert sum(1 for _ in sampled_trees(policy)) == 2 ** 14
    assert sum(p for p, *_ in sampled_trees(policy)) == pytest.approx(1.0, abs=1e-12)
    gradient, parts = policy.true_gradient(), policy.level_parts()
    assert torch.allclose(sum(parts), gradient, atol=0, rtol=0)
    assert min(float(p.norm()) for p in parts) > 1e-3  # every level matters
    paths = expected_update(policy, "paths")
    assert torch.allclose(paths, 4 * gradient, atol=1e-12, rtol=0)
    segment = expected_update(policy, "segment")
    assert torch.allclose(segment, sum(2 ** k * 0.5 * g for k, g in enumerate(parts, start=1)), atol=1e-12, rtol=0)
    assert _cosine(segment, gradient) < 0.99  # the leaves' weight pulls it off the true gradient
    sqrt_paths = expected_update(policy, "sqrt_paths")
    expected_sqrt = sum(2 ** k * 2 ** ((3 - k) / 2) * 0.5 * g for k, g in enumerate(parts, start=1))
    assert torch.allclose(sqrt_paths, expected_sqrt, atol=1e-12, rtol=0)


def test_branching_that_differs_by_level_shrinks_each_level_by_its_own_baseline():
    """3-2 tree: the first level's baseline shrinks by 1 - 1/3, the second's by 1 - 1/2, so E[paths] =
    3 * 2 * (2/3) g_1 + 6 * 1 * (1/2) g_2 is not a multiple of grad J; V(n) less the mean of its siblings
    alone (b / (b - 1) times the advantage) makes it 6 grad J."""
    policy = TabularPolicy((3, 2), vocabulary=2, seed=2)
    gradient, (g1, g2) = policy.true_gradient(), policy.level_parts()
    paths = expected_update(policy, "paths")
    assert torch.allclose(paths, 4 * g1 + 3 * g2, atol=1e-12, rtol=0)
    assert _cosine(paths, gradient) < 0.9999
    assert torch.allclose(expected_update(policy, "paths", sibling_only_baseline=True), 6 * gradient, atol=1e-12, rtol=0)


def test_early_stops_make_leaf_counts_under_weight_the_responses_that_stop():
    """2-2 tree, a third token that stops at the first depth: a stopped first segment is one leaf path
    where a continued one is two, so E[paths] weights stopping less than the policy gradient does."""
    policy = TabularPolicy((2, 2), vocabulary=3, stop_depths=(0,), seed=3)
    gradient = policy.true_gradient()
    paths = expected_update(policy, "paths")
    cosine = _cosine(paths, gradient)
    assert 0.5 < cosine < 0.9999
    # Each segment once is still the level-weighted sum, stops or not.
    g1, g2 = policy.level_parts()
    assert torch.allclose(expected_update(policy, "segment"), 2 * 0.5 * g1 + 4 * 0.5 * g2, atol=1e-12, rtol=0)
