"""Prompt-aware micro-batches of packed training (spo_verl.adapters.packing.micro_batches): each uid's rows stay
whole within the token budget, a group over it is cut into runs that each fit, costs are the packed
(unique) token counts, every data-parallel rank gets the same number of micro-batches."""

from __future__ import annotations

import random

import pytest

from spo_verl.adapters.packing.micro_batches import packed_token_count, tree_micro_batch_indices


def distinct_prefixes(sequences) -> int:
    """The independent count: every distinct non-empty prefix is one packed token."""
    return len({tuple(sequence[: i + 1]) for sequence in sequences for i in range(len(sequence))})


# Tree a: prompt 10, two depth-1 nodes of 4 tokens, each with two 3-token leaves: 10 + 8 + 12 = 30.
PROMPT_A = list(range(100, 110))
TREE_A = [PROMPT_A + [1, 1, 1, 1] + [2, 2, 2], PROMPT_A + [1, 1, 1, 1] + [3, 3, 3],
          PROMPT_A + [4, 4, 4, 4] + [5, 5, 5], PROMPT_A + [4, 4, 4, 4] + [6, 6, 6]]
# Tree b: prompt 6, one leaf of 5 tokens.
TREE_B = [list(range(200, 206)) + [7] * 5]
# A GRPO group: prompt 5, three responses of 2-4 tokens.
GROUP = [[9, 8, 7, 6, 5, 1, 2], [9, 8, 7, 6, 5, 3], [9, 8, 7, 6, 5, 4, 4, 4]]


def test_packed_token_count_is_the_prefix_trie():
    assert packed_token_count(TREE_A[:1]) == 17
    assert packed_token_count(TREE_A[:2]) == 20
    assert packed_token_count(TREE_A) == 30
    assert packed_token_count(GROUP) == 5 + 2 + 1 + 3
    assert packed_token_count(TREE_A + TREE_B + GROUP) == 30 + 11 + 11
    assert packed_token_count([GROUP[0], GROUP[0]]) == 7  # identical rows (verl's padding rows) once
    assert packed_token_count([[1, 2, 3], [1, 2]]) == 3  # a row that is another's prefix adds nothing
    assert packed_token_count([]) == 0
    rng = random.Random(3)
    for _ in range(50):
        rows = [[rng.randrange(3) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 9))]
        assert packed_token_count(rows) == distinct_prefixes(rows)


def test_each_uid_stays_whole_within_the_budget():
    rows = TREE_B + TREE_A + GROUP
    uids = ["b"] + ["a"] * 4 + ["g"] * 3
    batches = tree_micro_batch_indices(rows, uids, budget=30)
    assert sorted(map(sorted, batches)) == [[0, 5, 6, 7], [1, 2, 3, 4]]
    assert all(packed_token_count([rows[r] for r in batch]) <= 30 for batch in batches)


def test_a_group_over_the_budget_is_cut_into_runs_that_fit():
    batches = tree_micro_batch_indices(TREE_A, ["a"] * 4, budget=20)
    assert sorted(map(sorted, batches)) == [[0, 1], [2, 3]]  # 17 + 3 = 20 tokens each
    assert [packed_token_count([TREE_A[r] for r in batch]) for batch in batches] == [20, 20]


def test_a_row_over_the_budget_gets_a_micro_batch_of_its_own():
    batches = tree_micro_batch_indices(TREE_A + TREE_B, ["a"] * 4 + [None], budget=10)
    assert sorted(map(sorted, batches)) == [[0], [1], [2], [3], [4]]


def test_rows_without_a_uid_are_units_of_their_own():
    batches = tree_micro_batch_indices(GROUP, [None] * 3, budget=8)
    assert sorted(map(sorted, batches)) == [[0], [1], [2]]


def test_every_rank_runs_as_many_micro_batches_as_the_busiest():
    rows, uids = TREE_A + TREE_B, ["a"] * 4 + ["b"]
    batches = tree_micro_batch_indices(rows, uids, budget=100, count_across_ranks=lambda count: 3)
    assert len(batches) == 3 and sorted(row for batch in batches for row in batch) == list(range(5))
    with pytest.raises(ValueError, match="this data-parallel rank has 1 rows, too few for the 2 micro-batches"):
        tree_micro_batch_indices(TREE_B, ["b"], budget=100, count_across_ranks=lambda count: 2)
    with pytest.raises(ValueError, match="has no rows, but another rank needs 1"):
        tree_micro_batch_indices([], [], budget=100, count_across_ranks=lambda count: 1)
    assert tree_micro_batch_indices([], [], budget=100) == []


def test_v1_balancing_orders_rows_uid_by_uid():
    from spo_verl.adapters.trainer.tree_balance import tree_order

    uids = ["b", "a", "b", "c", "a", "b", "pad1", "pad1"]
    assert tree_order(uids) == [0, 2, 5, 1, 4, 3, 6, 7]
    assert tree_order([]) == []


def test_verls_padding_rows_pack_as_one():
    """verl pads a batch with rows from one template under one uid (127 EOS prompt tokens, 1 response)."""
    padding = [[0] * 128 for _ in range(5)]
    assert packed_token_count(padding) == 128
    assert tree_micro_batch_indices(TREE_B + padding, ["b"] + ["pad42"] * 5, budget=200) == [[0, 1, 2, 3, 4, 5]]
