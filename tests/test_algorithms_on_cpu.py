"""SPO maths: the worked examples, exactly, and properties on random inputs."""

import math
import random

import pytest
import torch

from spo_verl.core.algorithms import (
    chain_token_advantages,
    chain_token_advantages_batched,
    cutpoint_segment_starts,
    delimiter_segment_starts,
    fixed_count_segment_starts,
    probability_mask,
    tree_node_advantages,
    tree_node_advantages_batched,
    tree_values,
    tree_values_batched,
)

CHAIN_PROBS = [0.99, 0.72, 1.0, 0.85, 1.0, 0.56, 0.92, 0.23, 0.98, 0.11, 1.0]
# The paper's figure: root 0 with children a=1, b=2, c=3, each with three leaves.
PAPER_PARENTS = [-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
PAPER_LEAF_REWARDS = dict(zip(range(4, 13), [1, 0, 1, 1, 1, 1, 0, 0, 0]))


def test_chain_worked_example():
    starts = cutpoint_segment_starts(CHAIN_PROBS, threshold=0.9, interval=2)
    assert starts == [1, 5, 9]
    advantages = chain_token_advantages(len(CHAIN_PROBS), starts, [0.5, 0.25, 0.75], 1.0)
    assert advantages == pytest.approx([0, -0.25, -0.25, -0.25, -0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25])
    log_probs = torch.tensor(CHAIN_PROBS).log()
    mask = probability_mask(log_probs, torch.ones(len(CHAIN_PROBS)), threshold=0.9)
    masked = (torch.tensor(advantages) * mask).tolist()
    assert masked == pytest.approx([0, -0.25, 0, -0.25, 0, 0.5, 0, 0.5, 0, 0.25, 0])


def test_cutpoint_intervals():
    assert cutpoint_segment_starts(CHAIN_PROBS, 0.9, 1) == [1, 3, 5, 7, 9]
    assert cutpoint_segment_starts(CHAIN_PROBS, 0.9, 5) == [1]
    assert cutpoint_segment_starts(CHAIN_PROBS, 0.5, 1) == [7, 9]
    assert cutpoint_segment_starts([1.0, 0.95], 0.9, 5) == []
    assert cutpoint_segment_starts([], 0.9, 5) == []
    with pytest.raises(ValueError, match="interval"):
        cutpoint_segment_starts(CHAIN_PROBS, 0.9, 0)
    with pytest.raises(ValueError, match="threshold"):
        cutpoint_segment_starts(CHAIN_PROBS, 1.5, 2)


def test_chain_head_without_cutpoint_and_no_cutpoint_at_all():
    assert chain_token_advantages(4, [2], [0.25], 1.0) == [0, 0, 0.75, 0.75]
    assert chain_token_advantages(3, [], [], 1.0) == [0, 0, 0]
    assert chain_token_advantages(0, [], [], 1.0) == []
    # A cutpoint at token 0: its boundary state is the bare prompt.
    assert chain_token_advantages(2, [0], [0.5], 0.0) == [-0.5, -0.5]


def test_chain_rejects_inconsistent_segments():
    with pytest.raises(ValueError, match="one boundary value per segment"):
        chain_token_advantages(4, [1, 2], [0.5], 1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        chain_token_advantages(4, [2, 1], [0.5, 0.5], 1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        chain_token_advantages(4, [4], [0.5], 1.0)


def test_chain_single_segment_gives_reward_minus_value():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 20)
        start = rng.randrange(n)
        value, reward = rng.random(), rng.choice([0.0, 1.0])
        advantages = chain_token_advantages(n, [start], [value], reward)
        assert advantages[:start] == [0.0] * start
        assert advantages[start:] == pytest.approx([reward - value] * (n - start))


def test_fixed_count_and_delimiter_partitions():
    assert fixed_count_segment_starts(10, 3) == [0, 4, 7]
    assert fixed_count_segment_starts(9, 3) == [0, 3, 6]
    assert fixed_count_segment_starts(2, 5) == [0, 1]
    assert fixed_count_segment_starts(0, 3) == []
    with pytest.raises(ValueError, match="num_segments"):
        fixed_count_segment_starts(10, 0)
    newline = 7
    assert delimiter_segment_starts([1, 2, newline, 3, newline, 4], {newline}) == [0, 3, 5]
    assert delimiter_segment_starts([1, newline], {newline}) == [0]
    assert delimiter_segment_starts([1, 2], {newline}) == [0]
    assert delimiter_segment_starts([], {newline}) == []


def test_tree_worked_example():
    values = tree_values(PAPER_PARENTS, PAPER_LEAF_REWARDS)
    assert values[:4] == pytest.approx([5 / 9, 2 / 3, 1.0, 0.0])
    advantages = tree_node_advantages(PAPER_PARENTS, values)
    assert advantages[:4] == pytest.approx([0, 1 / 9, 4 / 9, -5 / 9])
    assert advantages[4:7] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert advantages[7:] == [0.0] * 6


def test_tree_worked_example_std_normalized():
    values = tree_values(PAPER_PARENTS, PAPER_LEAF_REWARDS)
    advantages = tree_node_advantages(PAPER_PARENTS, values, std_normalize=True)
    assert advantages[1:4] == pytest.approx([0.26726, 1.06904, -1.33631], abs=1e-5)
    assert advantages[4:7] == pytest.approx([0.70711, -1.41421, 0.70711], abs=1e-5)
    assert advantages[7:] == [0.0] * 6


def test_tree_value_is_mean_of_children_not_of_leaves():
    # Node 1 stopped early (a leaf at depth 1); node 2 has two leaves.
    parents = [-1, 0, 0, 2, 2]
    values = tree_values(parents, {1: 1.0, 3: 0.0, 4: 1.0})
    assert values == pytest.approx([0.75, 1.0, 0.5, 0.0, 1.0])  # mean over leaves would be 2/3


def test_tree_rejects_bad_input():
    with pytest.raises(ValueError, match="root"):
        tree_values([0, 0], {1: 1.0})
    with pytest.raises(ValueError, match="leaves"):
        tree_values([-1, 0, 0], {1: 1.0})
    with pytest.raises(ValueError, match="cycle"):
        tree_values([-1, 2, 1], {})


def random_tree(rng, branching_choices=(1, 2, 3, 4), max_depth=3, stop_probability=0.25):
    parents, frontier = [-1], [(0, 0)]
    while frontier:
        node, depth = frontier.pop()
        if depth == max_depth or (depth > 0 and rng.random() < stop_probability):
            continue
        for _ in range(rng.choice(branching_choices)):
            parents.append(node)
            frontier.append((len(parents) - 1, depth + 1))
    has_children = set(parents[1:])
    rewards = {n: rng.choice([0.0, 1.0, rng.random()]) for n in range(len(parents)) if n not in has_children}
    return parents, rewards


def test_siblings_are_centred_and_batched_tree_matches_reference():
    rng = random.Random(1)
    for _ in range(200):
        parents, rewards = random_tree(rng)
        values = tree_values(parents, rewards)
        plain = tree_node_advantages(parents, values)
        children = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        for parent, kids in children.items():
            if parent >= 0:
                assert sum(plain[k] for k in kids) == pytest.approx(0.0, abs=1e-9)
        parent_tensor = torch.tensor(parents)
        leaf_tensor = torch.tensor([rewards.get(n, float("nan")) for n in range(len(parents))], dtype=torch.float64)
        batched_values = tree_values_batched(parent_tensor, leaf_tensor)
        assert batched_values.tolist() == pytest.approx(values, abs=1e-12)
        for std_normalize in (False, True):
            reference = tree_node_advantages(parents, values, std_normalize=std_normalize)
            batched = tree_node_advantages_batched(parent_tensor, batched_values, std_normalize=std_normalize)
            assert batched.tolist() == pytest.approx(reference, abs=1e-9)
            assert torch.isfinite(batched).all()


def test_batched_tree_handles_a_forest_and_degenerate_trees():
    # Three trees in one parent array: the paper's tree, a lone root, and a one-child chain.
    offset = len(PAPER_PARENTS)
    parents = PAPER_PARENTS + [-1] + [-1, offset + 1]
    leaf_rewards = torch.zeros(len(parents), dtype=torch.float64)
    for node, reward in PAPER_LEAF_REWARDS.items():
        leaf_rewards[node] = reward
    leaf_rewards[offset] = 0.5
    leaf_rewards[offset + 2] = 1.0
    values = tree_values_batched(torch.tensor(parents), leaf_rewards)
    advantages = tree_node_advantages_batched(torch.tensor(parents), values, std_normalize=True)
    assert values[offset:].tolist() == [0.5, 1.0, 1.0]
    assert advantages[offset:].tolist() == [0.0, 0.0, 0.0]  # a lone child gets 0
    assert advantages[1:4].tolist() == pytest.approx([0.26726, 1.06904, -1.33631], abs=1e-5)
    empty = torch.zeros(0, dtype=torch.long)
    assert tree_values_batched(empty, torch.zeros(0)).numel() == 0
    assert tree_node_advantages_batched(empty, torch.zeros(0), std_normalize=True).numel() == 0


def test_one_level_tree_equals_verl_grpo_without_std():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = random.Random(2)
    group_sizes = [rng.randint(2, 8) for _ in range(20)]
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(sum(group_sizes))]
    parents, uids, roots = [], [], []
    for group, size in enumerate(group_sizes):
        roots.append(len(parents))
        parents.append(-1)
        for _ in range(size):
            parents.append(roots[-1])
            uids.append(f"p{group}")
    leaf_rewards = torch.zeros(len(parents), dtype=torch.float64)
    leaf_index = [n for n, p in enumerate(parents) if p >= 0]
    leaf_rewards[leaf_index] = torch.tensor(rewards, dtype=torch.float64)
    values = tree_values_batched(torch.tensor(parents), leaf_rewards)
    tree = tree_node_advantages_batched(torch.tensor(parents), values)[leaf_index]

    length = 5
    token_rewards = torch.zeros(len(rewards), length, dtype=torch.float64)
    token_rewards[:, -1] = torch.tensor(rewards, dtype=torch.float64)
    grpo, _ = compute_grpo_outcome_advantage(
        token_rewards, torch.ones(len(rewards), length), index=__import__("numpy").array(uids),
        norm_adv_by_std_in_grpo=False,
    )
    assert grpo[:, 0].tolist() == pytest.approx(tree.tolist(), abs=1e-6)


def test_batched_chain_matches_reference_on_random_inputs():
    rng = random.Random(3)
    batch, length = 64, 24
    probs = torch.rand(batch, length) ** 0.3
    probs[0] = 1.0  # no low-probability token at all
    probs[1, 0] = 0.1  # a cutpoint at token 0
    response_mask = torch.ones(batch, length)
    for b in range(batch):
        response_mask[b, rng.randint(0, length) :] = 0  # early EOS, including empty responses
    interval = 3
    row_starts_of = [cutpoint_segment_starts(probs[b, : int(response_mask[b].sum())].tolist(), 0.9, interval)
                     for b in range(batch)]
    counts = torch.tensor([len(row_starts) for row_starts in row_starts_of])
    starts = torch.full((batch, int(counts.max())), length, dtype=torch.long)  # padding past every row's tokens
    for b, row_starts in enumerate(row_starts_of):
        starts[b, : len(row_starts)] = torch.tensor(row_starts, dtype=torch.long)
    values = torch.rand(batch, max(starts.shape[1], 1))[:, : starts.shape[1]]
    rewards = torch.tensor([rng.choice([0.0, 1.0]) for _ in range(batch)])
    batched = chain_token_advantages_batched(starts, values, counts, rewards, length)
    assert torch.isfinite(batched).all()
    for b in range(batch):
        n = int(response_mask[b].sum())
        row_starts = row_starts_of[b]
        expected = chain_token_advantages(n, row_starts, values[b, : len(row_starts)].tolist(), float(rewards[b]))
        assert batched[b, :n].tolist() == pytest.approx(expected, abs=1e-6)
    assert counts[0] == 0 and batched[0].abs().sum() == 0


def test_batched_chain_is_exactly_the_reference_in_float64():
    """The scatter/cumsum/gather rewrite copies each segment's advantage: bit-equal to the plain
    reference, for heads, a start at 0, single segments, rows without segments and padded columns."""
    rng = random.Random(11)
    batch, length, width = 200, 57, 9
    starts = torch.full((batch, width), length, dtype=torch.long)  # padding past every row's tokens
    values = torch.zeros(batch, width, dtype=torch.float64)
    counts = torch.zeros(batch, dtype=torch.long)
    rewards = torch.tensor([rng.choice([0.0, 1.0, -2.0, 0.3]) for _ in range(batch)], dtype=torch.float64)
    rows = []
    for b in range(batch):
        row_starts = sorted(rng.sample(range(length), rng.randint(0, width)))
        if b == 1:
            row_starts = [0]
        row_values = [rng.random() for _ in row_starts]
        counts[b] = len(row_starts)
        starts[b, : len(row_starts)] = torch.tensor(row_starts, dtype=torch.long)
        values[b, : len(row_values)] = torch.tensor(row_values, dtype=torch.float64)
        values[b, len(row_values) :] = 123.0  # never read
        rows.append((row_starts, row_values))
    batched = chain_token_advantages_batched(starts, values, counts, rewards, length)
    assert batched.dtype == torch.float64
    for b, (row_starts, row_values) in enumerate(rows):
        assert batched[b].tolist() == chain_token_advantages(length, row_starts, row_values, float(rewards[b]))
    assert any(not row_starts for row_starts, _ in rows)


def test_tree_rows_token_advantages_are_exactly_the_reference():
    """tree_token_advantages (pieces by scatter/cumsum/gather) against per-token advantages written
    out with the plain reference: early-stopped leaves, a padding row, a response mask shorter than
    the path, each segment trained by its first row only, zero advantages dropped."""
    from spo_verl.core.algorithms.tree_rows import tree_token_advantages

    # Tree "a": root -> 1, 2; 1 -> 3, 4; 2 stops early. Tree "b": root -> 1, 2; 1 -> 3, 4; 2 -> 5, 6.
    rows = [("a", [1, 3], [4, 9]), ("a", [1, 4], [4, 7]), ("a", [2], [6]), (None, None, None),
            ("b", [1, 3], [3, 10]), ("b", [1, 4], [3, 5]), ("b", [2, 5], [2, 8]), ("b", [2, 6], [2, 4])]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    length = 10
    response_mask = torch.ones(len(rows), length)
    response_mask[0, 8:] = 0  # the mask ends before the last segment does
    response_mask[3] = 0
    result = tree_token_advantages([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                   rewards, response_mask)
    expected = torch.zeros(len(rows), length, dtype=torch.float64)
    trained = torch.zeros(len(rows), length, dtype=torch.bool)
    for tree in ("a", "b"):
        members = [i for i, r in enumerate(rows) if r[0] == tree]
        nodes = sorted({n for i in members for n in rows[i][1]})
        parent_of = {}
        for i in members:
            for parent, child in zip([0] + rows[i][1], rows[i][1]):
                parent_of[child] = parent
        order = [0] + nodes
        parents = [-1] + [order.index(parent_of[n]) for n in nodes]
        leaf_rewards = {order.index(rows[i][1][-1]): float(rewards[i]) for i in members}
        advantages = dict(zip(order, tree_node_advantages(parents, tree_values(parents, leaf_rewards))))
        owned = set()
        for i in members:
            start = 0
            for node, end in zip(rows[i][1], rows[i][2]):
                expected[i, start:end] = advantages[node]
                if node not in owned and advantages[node] != 0:
                    trained[i, start:end] = True
                owned.add(node)
                start = end
    expected *= response_mask.double()
    trained &= response_mask.bool()
    assert result.token_advantages.tolist() == expected.tolist()
    assert torch.equal(result.trained_mask, trained)
    assert trained.any() and not trained[3].any()


def test_batched_functions_accept_empty_batches():
    starts, counts = torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    out = chain_token_advantages_batched(starts, torch.zeros(0, 0), counts, torch.zeros(0), 7)
    assert out.shape == (0, 7)
    out = chain_token_advantages_batched(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0), torch.zeros(3), torch.ones(3), 4)
    assert out.shape == (3, 4) and out.abs().sum() == 0


def test_probability_mask():
    log_probs = torch.tensor([[0.5, 0.95, 0.2], [0.6, 0.3, 1.0]]).log()
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mask = probability_mask(log_probs, response_mask, 0.9)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, False, True], [True, True, False]]
    assert not probability_mask(torch.zeros(2, 3), torch.ones(2, 3)).any()
    assert math.isclose(probability_mask(log_probs, response_mask, 1.0).sum().item(), 5)
    with pytest.raises(ValueError, match="threshold"):
        probability_mask(log_probs, response_mask, 0.0)


# ------------------------------------------------------------------------------------------------
# The vectorised tree rows (numpy forest, chunked token fill) against the former per-row version
# ------------------------------------------------------------------------------------------------


def _former_tree_token_advantages(tree_ids, paths, segment_ends, rewards, response_mask, std_normalize=False,
                                  drop_zero_advantage=True, max_trained_segments_per_tree=None, generator=None):
    """tree_token_advantages as it was before the rows were vectorised: the per-row forest, per-row
    tables, and tokens by scatter/cumsum/gather. Returns what the estimator used (advantages with the
    untrained tokens zeroed) as a fifth value."""
    from spo_verl.core.algorithms.batched import node_depths_batched
    from spo_verl.core.algorithms.tree_rows import build_forest_reference, _sample_per_tree

    batch_size, length = response_mask.shape
    forest = build_forest_reference(tree_ids, paths)
    parents = torch.tensor(forest.parents, dtype=torch.long)
    width = max((len(nodes) for nodes in forest.row_nodes), default=0)
    node_rows, end_rows, leaf_rows = [], [], []
    for row, nodes in enumerate(forest.row_nodes):
        if not nodes:
            node_rows.append([-1] * width)
            end_rows.append([length + 1] * width)
            continue
        ends = list(segment_ends[row])
        if len(ends) != len(nodes) or any(b <= a for a, b in zip([0] + ends, ends)) or ends[-1] > length:
            raise ValueError(
                f"row {row}: segment_ends must be {len(nodes)} increasing offsets ending at most at the response "
                f"length {length}, got {ends}"
            )
        padding = width - len(nodes)
        node_rows.append(nodes + [-1] * padding)
        end_rows.append(ends + [length + 1] * padding)
        leaf_rows.append((nodes[-1], row))
    node_table = torch.tensor(node_rows, dtype=torch.long).reshape(batch_size, width)
    end_table = torch.tensor(end_rows, dtype=torch.long).reshape(batch_size, width)
    leaf_rewards = torch.zeros(len(forest.parents), dtype=torch.float64)
    if leaf_rows:
        leaves, rows_of_leaves = zip(*leaf_rows)
        leaf_rewards[list(leaves)] = rewards[list(rows_of_leaves)].double()
    values = tree_values_batched(parents, leaf_rewards)
    node_advantages = tree_node_advantages_batched(parents, values, std_normalize=std_normalize)
    rows = torch.arange(batch_size)[:, None].expand_as(node_table)
    present = node_table >= 0
    owner = torch.full((len(forest.parents),), batch_size, dtype=torch.long)
    owner.scatter_reduce_(0, node_table[present], rows[present], reduce="amin")
    trainable = parents >= 0
    if drop_zero_advantage:
        trainable &= node_advantages != 0
    if max_trained_segments_per_tree is not None:
        trainable &= _sample_per_tree(parents, trainable, max_trained_segments_per_tree, generator)
    safe_node = node_table.clamp(min=0)
    piece_advantages = torch.zeros(batch_size, width + 1, dtype=rewards.dtype)
    piece_advantages[:, :width] = torch.where(present, node_advantages[safe_node], 0.0).to(rewards.dtype)
    piece_trained = torch.zeros(batch_size, width + 1, dtype=torch.bool)
    piece_trained[:, :width] = present & (owner[safe_node] == rows) & trainable[safe_node]
    token_advantages = torch.zeros(batch_size, length, dtype=rewards.dtype)
    trained = torch.zeros(batch_size, length, dtype=torch.bool)
    if width and length:
        marks = torch.zeros(batch_size, length, dtype=torch.long)
        marks.scatter_add_(1, end_table.clamp(max=length - 1), (present & (end_table < length)).long())
        piece = torch.cumsum(marks, dim=1)
        in_response = response_mask.bool()
        token_advantages = torch.gather(piece_advantages, 1, piece).masked_fill_(~in_response, 0)
        trained = torch.gather(piece_trained, 1, piece) & in_response
    estimator = token_advantages.clone().masked_fill_(~trained, 0.0)
    return token_advantages, trained, values, node_advantages, node_depths_batched(parents), estimator


def _random_tree_rows(rng, trees, node_ids="int"):
    """Leaf rows of random trees, shuffled: branching 1-4, leaves at depths 1-4 (early EOS), one-leaf
    trees, padding rows (None), node ids sparse, negative or strings, tree ids strings or ints."""
    rows = []
    for tree in range(trees):
        tree_id = f"t{tree}" if tree % 3 else tree * 7
        counter = iter(rng.sample(range(-50, 10_000), 400))
        max_depth = rng.randint(1, 4)

        def grow(prefix, depth):
            if depth == max_depth or (depth and rng.random() < 0.25):
                rows.append((tree_id, prefix))
                return
            for _ in range(1 if rng.random() < 0.15 else rng.randint(1, 4)):
                node = next(counter)
                grow(prefix + [f"n{node}" if node_ids == "str" else node], depth + 1)

        grow([], 0)
    rows += [(None, None)] * rng.randint(0, 4)
    rng.shuffle(rows)
    return [row[0] for row in rows], [row[1] for row in rows]


def _random_ends(rng, paths, length):
    ends = []
    for path in paths:
        if path is None:
            ends.append(None)
            continue
        offsets = sorted(rng.sample(range(1, length + 1), len(path)))
        ends.append(offsets)
    return ends


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("seed", range(12))
def test_tree_rows_fast_path_is_bit_exact_with_the_former_version(seed):
    from spo_verl.core.algorithms import tree_rows
    from spo_verl.core.algorithms.tree_rows import build_forest, build_forest_reference, tree_token_advantages

    rng = random.Random(seed)
    tree_ids, paths = _random_tree_rows(rng, rng.randint(1, 6), node_ids="str" if seed % 4 == 3 else "int")
    length = rng.randint(6, 40)
    ends = _random_ends(rng, paths, length)
    batch = len(paths)
    reward_dtype = torch.float64 if seed % 2 else torch.float32
    rewards = torch.tensor([rng.choice([0.0, 1.0, 0.5, -0.25]) for _ in range(batch)], dtype=reward_dtype)
    lengths = [rng.randint(0, length) for _ in range(batch)]
    response_mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()
    response_mask[torch.rand(batch, length, generator=torch.Generator().manual_seed(seed)) < 0.05] = 0  # holes

    reference = build_forest_reference(tree_ids, paths)
    fast = build_forest(tree_ids, paths)
    assert fast.parents == reference.parents and fast.row_nodes == reference.row_nodes
    if seed % 4 != 3:
        assert tree_rows._forest_tables(tree_ids, paths) is not None  # integer ids take the vectorised path

    old_chunk = tree_rows._CHUNK_TOKENS
    try:
        tree_rows._CHUNK_TOKENS = length * 3  # several chunks, the last one short
        for std_normalize, drop_zero, budget in [(False, True, None), (True, False, None), (False, True, 2),
                                                 (True, True, 1)]:
            kwargs = dict(std_normalize=std_normalize, drop_zero_advantage=drop_zero,
                          max_trained_segments_per_tree=budget)
            former = _former_tree_token_advantages(tree_ids, paths, ends, rewards, response_mask,
                                                   generator=torch.Generator().manual_seed(seed), **kwargs)
            for zero_untrained in (False, True):
                result = tree_token_advantages(tree_ids, paths, ends, rewards, response_mask,
                                               generator=torch.Generator().manual_seed(seed),
                                               zero_untrained=zero_untrained, **kwargs)
                expected_tokens = former[5] if zero_untrained else former[0]
                assert _same_bits(result.token_advantages, expected_tokens)
                assert torch.equal(result.trained_mask, former[1])
                assert _same_bits(result.node_values, former[2])
                assert _same_bits(result.node_advantages, former[3])
                assert torch.equal(result.node_depths, former[4])
    finally:
        tree_rows._CHUNK_TOKENS = old_chunk


def test_tree_rows_fast_path_edge_cases():
    from spo_verl.core.algorithms.tree_rows import tree_token_advantages

    for tree_ids, paths, ends in [
        ([None, None], [None, None], [None, None]),  # padding only
        (["a"], [[5]], [[3]]),  # a one-leaf tree
        (["a", None, "b"], [[1], None, [1]], [[4], None, [2]]),  # the same node id in two trees
    ]:
        for length in (0, 4) if ends[0] is None else (4,):
            rewards = torch.tensor([1.0] * len(paths))
            mask = torch.ones(len(paths), length)
            former = _former_tree_token_advantages(tree_ids, paths, ends, rewards, mask)
            result = tree_token_advantages(tree_ids, paths, ends, rewards, mask)
            assert _same_bits(result.token_advantages, former[0]) and torch.equal(result.trained_mask, former[1])
            assert _same_bits(result.node_values, former[2]) and torch.equal(result.node_depths, former[4])


@pytest.mark.parametrize("tree_ids, paths, ends", [
    (["a", "a"], [[1, 2], [3, 2]], [[1, 2], [1, 2]]),  # node 2 under two parents
    (["a", "a"], [[1, 1], [2]], [[1, 2], [1]]),  # a node its own parent
    (["a", "a", "a"], [[1, 2], [1, 3], [1, 2]], [[1, 2], [1, 2], [1, 2]]),  # a leaf returned twice
    (["a", "a"], [[1, 2], [1]], [[1, 2], [1]]),  # a row ends at a node with children
    (["a", "b"], [[1], []], [[1], []]),  # an empty path
    (["a", "a"], [[1], None], [[1], None]),  # no path
    (["a", "a"], [[1, 2], [1, 3]], [[1, 2], [1]]),  # too few ends
    (["a", "a"], [[1, 2], [1, 3]], [[1, 2], [2, 2]]),  # ends not increasing
    (["a", "a"], [[1, 2], [1, 3]], [[1, 2], [0, 2]]),  # an end at 0
    (["a", "a"], [[1, 2], [1, 3]], [[1, 2], [1, 9]]),  # past the response
    (["a", "a"], [[1, 2], [1, 3]], [[1, 2], [1.5, 3]]),  # non-integer ends are truncated, as before
    (["a", "a"], [[1, 2], [1, 3.0]], [[1, 2], [1, 3]]),  # a float node id
])
def test_tree_rows_errors_and_odd_inputs_match_the_former_version(tree_ids, paths, ends):
    from spo_verl.core.algorithms.tree_rows import tree_token_advantages

    rewards, mask = torch.tensor([1.0, 0.0]), torch.ones(2, 4)
    try:
        former = _former_tree_token_advantages(tree_ids, paths, ends, rewards, mask)
    except Exception as error:  # noqa: BLE001 - the same type and message are expected
        with pytest.raises(type(error)) as raised:
            tree_token_advantages(tree_ids, paths, ends, rewards, mask)
        assert str(raised.value) == str(error)
        return
    result = tree_token_advantages(tree_ids, paths, ends, rewards, mask)
    assert _same_bits(result.token_advantages, former[0]) and torch.equal(result.trained_mask, former[1])
    assert _same_bits(result.node_values, former[2])
