"""Token-budget micro-batches that keep each prompt's rows together (packed training, dynamic batch size).

verl's dynamic batch size (``use_dynamic_bsz``) cuts a batch into micro-batches of at most
``max_token_len_per_gpu`` row tokens, balancing by sequence length alone, so the responses of one
prompt (a GRPO group, the leaves of an SPO tree) land in different micro-batches and their shared
prefix is computed once per micro-batch. With packing a micro-batch costs its *packed* tokens; here
the rows of one uid form one unit (costed at its unique tokens), units are binned first-fit
decreasing under the same budget (a bin is costed at the sum of its units, an upper bound: units may
share more, such as a common few-shot preamble), and a unit larger than the budget is cut into runs
of consecutive rows. Every data-parallel rank runs the same number of micro-batches (FSDP's
collectives need it): ranks with fewer split their largest ones.

Same return value as verl's ``prepare_micro_batches``: the micro-batches and, per micro-batch, the
row indices that verl's ``restore_dynamic_batch`` uses to put outputs back in batch order.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from spo_verl.core.packing.verl_rows import row_sequences, row_uids

__all__ = ["packed_token_count", "tree_micro_batch_indices", "tree_micro_batches"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    for position in range(length):
        if a[position] != b[position]:
            return position
    return length


def packed_token_count(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens a packed forward computes for these rows: the size of their prefix trie, i.e. the total
    length less the prefix each row shares with its neighbour in lexicographic order."""
    ordered = sorted(list(sequence) for sequence in sequences)
    shared = sum(_common_prefix(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(map(len, ordered)) - shared


def _units(uids: Sequence) -> list[list[int]]:
    """Rows grouped by uid, in order of first appearance; a row without a uid is a unit of its own."""
    units: dict = {}
    for row, uid in enumerate(uids):
        units.setdefault(("row", row) if uid is None else ("uid", uid), []).append(row)
    return list(units.values())


def _cut_to_budget(sequences, unit: list[int], budget: int) -> list[list[int]]:
    """Runs of a unit's rows, each within ``budget`` packed tokens (a row over it on its own). A row
    adds its length less the longest prefix it shares with a row already in the run, which is the
    prefix shared with its neighbours in lexicographic order."""
    runs, current, ordered, used = [], [], [], 0
    for row in unit:
        sequence = list(sequences[row])
        place = bisect.bisect_left(ordered, sequence)
        shared = max([_common_prefix(sequence, ordered[i]) for i in (place - 1, place) if 0 <= i < len(ordered)],
                     default=0)
        if current and used + len(sequence) - shared > budget:
            runs.append(current)
            current, ordered, used, place, shared = [], [], 0, 0, 0
        current.append(row)
        ordered.insert(place, sequence)
        used += len(sequence) - shared
    runs.append(current)
    return runs


def tree_micro_batch_indices(sequences: Sequence[Sequence[int]], uids: Sequence, budget: int,
                             count_across_ranks: Callable[[int], int] = lambda count: count) -> list[list[int]]:
    """Row indices of each micro-batch. ``count_across_ranks`` maps this rank's micro-batch count to the
    count every rank must run (the maximum over data-parallel ranks)."""
    cost = lambda rows: packed_token_count([sequences[r] for r in rows])  # noqa: E731
    pieces = [(cost(run), run) for unit in _units(uids) for run in _cut_to_budget(sequences, unit, budget)]
    pieces.sort(key=lambda piece: piece[0], reverse=True)
    bins: list[list[int]] = []
    costs: list[int] = []
    for piece_cost, rows in pieces:
        for index, used in enumerate(costs):
            if used + piece_cost <= budget:
                bins[index].extend(rows)
                costs[index] += piece_cost
                break
        else:
            bins.append(list(rows))
            costs.append(piece_cost)
    wanted = count_across_ranks(len(bins))
    while len(bins) < wanted:
        if not bins:
            raise ValueError(f"packed training: this data-parallel rank has no rows, but another rank needs {wanted} "
                             f"micro-batches")
        largest = max(range(len(bins)), key=lambda index: (len(bins[index]), costs[index]))
        rows = bins[largest]
        if len(rows) < 2:
            raise ValueError(f"packed training: this data-parallel rank has {sum(map(len, bins))} rows, too few "
                             f"for the {wanted} micro-batches another rank needs")
        halves = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
        bins[largest:largest + 1] = halves
        costs[largest:largest + 1] = [cost(half) for half in halves]
    return [sorted(rows) for rows in bins if rows]


def tree_micro_batches(data, dp_group=None, same_micro_num_in_dp=True, **verl_options):
    """Drop-in for verl's ``prepare_micro_batches`` (``verl.workers.engine.utils``): prompt-aware token
    budgets under ``use_dynamic_bsz``, verl's own fixed-size chunks otherwise."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.device import get_device_name
    from verl.workers.engine.utils import prepare_micro_batches

    if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=same_micro_num_in_dp,
                                     **verl_options)
    budget = int(data["max_token_len_per_gpu"]) * int(tu.get_non_tensor_data(data=data, key="sp_size", default=1))

    def count_across_ranks(count: int) -> int:
        if dp_group is None or not same_micro_num_in_dp or not torch.distributed.is_initialized():
            return count
        total = torch.tensor([count], device=get_device_name())
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        return int(total.item())

    sequences, _ = row_sequences(data)
    indices = tree_micro_batch_indices(sequences, row_uids(data), budget, count_across_ranks)
    return [tu.index_select_tensor_dict(data, rows) for rows in indices], indices
