"""Tree-aware micro-batches of packed training (spo_verl.packing.micro_batches): trees stay whole
within the token budget, a tree over it is cut into runs that each fit, costs are the packed token
counts, every data-parallel rank gets the same number of micro-batches."""

from __future__ import annotations

import pytest

from spo_verl.packing.micro_batches import packed_cost, tree_micro_batch_indices
from spo_verl.packing.verl_rows import RowPlacement


def tree_rows(tree_id, prompt, leaves):
    """Leaf rows of a tree: ``leaves`` = [(path node ids, segment ends)]."""
    return [RowPlacement(("tree", tree_id), list(path), list(ends), prompt, ends[-1]) for path, ends in leaves]


# Tree a: prompt 10, two depth-1 nodes of 4 tokens, each with two 3-token leaves: 10 + 8 + 12 = 30.
TREE_A = tree_rows("a", 10, [((1, 3), (4, 7)), ((1, 4), (4, 7)), ((2, 5), (4, 7)), ((2, 6), (4, 7))])
# Tree b: prompt 6, one leaf of 5 tokens.
TREE_B = tree_rows("b", 6, [((1,), (5,))])
PLAIN = RowPlacement(("row", 5), [0], [8], 4, 8)
NO_RESPONSE = RowPlacement(None, None, None, 7, 0)


def test_packed_cost_counts_each_prompt_and_node_once():
    rows = TREE_A + TREE_B + [PLAIN, NO_RESPONSE]
    assert packed_cost(rows, [0]) == 10 + 4 + 3
    assert packed_cost(rows, [0, 1]) == 10 + 4 + 3 + 3
    assert packed_cost(rows, [0, 1, 2, 3]) == 30
    assert packed_cost(rows, [4]) == 11
    assert packed_cost(rows, [5, 6]) == 12 + 7
    assert packed_cost(rows, list(range(7))) == 30 + 11 + 12 + 7


def test_trees_stay_whole_within_the_budget():
    rows = TREE_B + TREE_A + [PLAIN]  # tree a's rows are 1..4
    batches = tree_micro_batch_indices(rows, budget=30)
    assert sorted(map(sorted, batches)) == [[0, 5], [1, 2, 3, 4]]
    assert all(packed_cost(rows, batch) <= 30 for batch in batches)
    assert sorted(row for batch in batches for row in batch) == list(range(6))


def test_a_tree_over_the_budget_is_cut_into_runs_that_fit():
    batches = tree_micro_batch_indices(TREE_A, budget=20)
    assert sorted(map(sorted, batches)) == [[0, 1], [2, 3]]  # 17 + 3 = 20 tokens each
    assert [packed_cost(TREE_A, batch) for batch in batches] == [20, 20]


def test_a_row_over_the_budget_gets_a_micro_batch_of_its_own():
    batches = tree_micro_batch_indices(TREE_A + [PLAIN], budget=10)
    assert sorted(map(sorted, batches)) == [[0], [1], [2], [3], [4]]


def test_every_rank_runs_as_many_micro_batches_as_the_busiest():
    batches = tree_micro_batch_indices(TREE_A + TREE_B, budget=100, count_across_ranks=lambda count: 3)
    assert len(batches) == 3 and sorted(row for batch in batches for row in batch) == list(range(5))
    with pytest.raises(ValueError, match="this data-parallel rank has 1 rows, too few for the 2 micro-batches"):
        tree_micro_batch_indices(TREE_B, budget=100, count_across_ranks=lambda count: 2)
    with pytest.raises(ValueError, match="has no rows, but another rank needs 1"):
        tree_micro_batch_indices([], budget=100, count_across_ranks=lambda count: 1)
    assert tree_micro_batch_indices([], budget=100) == []


def test_v1_balancing_orders_rows_tree_by_tree():
    from spo_verl.trainer.tree_balance import tree_order

    uids = ["b", "a", "b", "c", "a", "b", "pad1", "pad1"]
    assert tree_order(uids) == [0, 2, 5, 1, 4, 3, 6, 7]
    assert tree_order([]) == []


def test_verls_padding_rows_pack_as_one():
    """verl pads a batch with rows from one template under one uid (127 EOS prompt tokens, 1 response)."""
    padding = [RowPlacement(("padding", "pad42"), [0], [1], 127, 1) for _ in range(5)]
    assert packed_cost(padding, list(range(5))) == 128
    assert tree_micro_batch_indices(TREE_B + padding, budget=200) == [[0, 1, 2, 3, 4, 5]]
