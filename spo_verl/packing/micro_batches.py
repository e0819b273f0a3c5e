"""Token-budget micro-batches that keep each SPO tree together (packed training, dynamic batch size).

verl's dynamic batch size (``use_dynamic_bsz``) cuts a batch into micro-batches of at most
``max_token_len_per_gpu`` row tokens, balancing by sequence length alone, so the leaves of one tree
land in different micro-batches and their shared prefix is computed once per micro-batch. With
packing a micro-batch costs its *packed* tokens; here the rows of a tree form one unit (costed at
its unique tokens), units are binned first-fit decreasing under the same budget, and a tree larger
than the budget is cut into runs of its rows. Every data-parallel rank runs the same number of
micro-batches (FSDP's collectives need it): ranks with fewer split their largest ones.

Same return value as verl's ``prepare_micro_batches``: the micro-batches and, per micro-batch, the
row indices that verl's ``restore_dynamic_batch`` uses to put outputs back in batch order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spo_verl.packing.verl_rows import RowPlacement, row_placements

__all__ = ["packed_cost", "tree_micro_batch_indices", "tree_micro_batches"]


def packed_cost(placements: list[RowPlacement], rows: list[int]) -> int:
    """Tokens the packed forward computes for ``rows``: each tree's prompt and node segments once."""
    seen: set = set()
    cost = 0
    for row in rows:
        place = placements[row]
        if place.tree_key is None or place.tree_key[0] == "row":  # packed alone
            cost += place.prompt_length + place.response_length
            continue
        if (place.tree_key, "prompt") not in seen:
            seen.add((place.tree_key, "prompt"))
            cost += place.prompt_length
        start = 0
        for node, end in zip(place.path, place.segment_ends):
            if (place.tree_key, node) not in seen:
                seen.add((place.tree_key, node))
                cost += end - start
            start = end
    return cost


def _units(placements: list[RowPlacement]) -> list[list[int]]:
    """Rows grouped by tree (in order of first appearance; verl's padding rows form one group); every
    other row is a unit of its own."""
    units: dict = {}
    for row, place in enumerate(placements):
        shared = place.tree_key is not None and place.tree_key[0] != "row"  # a tree, or verl's padding rows
        key = place.tree_key if shared else ("alone", row)
        units.setdefault(key, []).append(row)
    return list(units.values())


def _cut_to_budget(placements, unit: list[int], budget: int) -> list[list[int]]:
    """Runs of a unit's rows, each within ``budget`` packed tokens (a row over it on its own)."""
    runs, current = [], []
    for row in unit:
        if current and packed_cost(placements, current + [row]) > budget:
            runs.append(current)
            current = []
        current.append(row)
    runs.append(current)
    return runs


def tree_micro_batch_indices(placements: list[RowPlacement], budget: int,
                             count_across_ranks: Callable[[int], int] = lambda count: count) -> list[list[int]]:
    """Row indices of each micro-batch. ``count_across_ranks`` maps this rank's micro-batch count to the
    count every rank must run (the maximum over data-parallel ranks)."""
    pieces = [run for unit in _units(placements) for run in _cut_to_budget(placements, unit, budget)]
    pieces.sort(key=lambda rows: packed_cost(placements, rows), reverse=True)
    bins: list[list[int]] = []
    costs: list[int] = []
    for rows in pieces:
        cost = packed_cost(placements, rows)
        for index, used in enumerate(costs):
            if used + cost <= budget:
                bins[index].extend(rows)
                costs[index] = packed_cost(placements, bins[index])
                break
        else:
            bins.append(list(rows))
            costs.append(cost)
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
        bins[largest:largest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
        costs[largest:largest + 1] = [packed_cost(placements, part) for part in bins[largest:largest + 2]]
    return [sorted(rows) for rows in bins if rows]


def tree_micro_batches(data, dp_group=None, same_micro_num_in_dp=True, **verl_options):
    """Drop-in for verl's ``prepare_micro_batches`` (``verl.workers.engine.utils``): tree-aware token
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

    indices = tree_micro_batch_indices(row_placements(data), budget, count_across_ranks)
    return [tu.index_select_tensor_dict(data, rows) for rows in indices], indices
