"""v1's batch balancing for packed training: the rows of each prompt (uid) stay next to each other.

verl's ``PPOTrainer._balance_batch`` reorders every row by sequence length to even out the tokens per
data-parallel rank (Karmarkar-Karp over rows), which scatters a prompt's responses (a GRPO group, an
SPO tree's leaves) over ranks and micro-batches, so a packed forward finds few rows that share a
prompt. With ``algorithm.spo.packing.enable`` the SPO trainer orders rows uid by uid instead
(padding rows last, as verl appends them) and cuts the batch into equal contiguous shares per rank,
as verl's dispatch does: a group is split only where a rank's share (or, inside the worker, a
mini-batch) ends. The price is token balance across ranks, logged under the same metric names as
verl's. The legacy trainer orders its rows with :func:`tree_order` too.
"""

from __future__ import annotations

from typing import Any

import transfer_queue as tq
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from spo_verl.adapters.trainer.transfer_queue_batch import stored_uids

__all__ = ["balance_keeping_trees", "tree_order"]


def tree_order(uids: list[str]) -> list[int]:
    """Row indices grouped by uid (one prompt, or one SPO tree, per uid), groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    return [row for rows in groups.values() for row in rows]


def balance_keeping_trees(trainer: Any, batch, metrics: dict, logging_prefix: str):
    """Drop-in for ``PPOTrainer._balance_batch`` that keeps each uid's rows contiguous (see the module doc)."""
    group = trainer.actor_rollout_wg
    if "actor" not in group._dispatch_info:
        group._dispatch_info["actor"] = group._query_dispatch_info("actor")
    dp_size = max(group._dispatch_info["actor"]) + 1
    batch = upsample_batch_to_divisible_size(batch, trainer._get_required_batch_multiple(dp_size),
                                             trainer.tokenizer.eos_token_id)
    stored = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid"])
    order = tree_order(stored_uids(stored))
    batch.reorder(order)
    share = len(order) // dp_size
    seqlens = [int(tag["seq_len"]) for tag in batch.tags]
    partitions = [list(range(rank * share, (rank + 1) * share)) for rank in range(dp_size)]
    metrics.update(log_seqlen_unbalance(seqlen_list=seqlens, partitions=partitions, prefix=logging_prefix))
    return batch
