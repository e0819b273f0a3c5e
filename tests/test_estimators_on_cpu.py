"""spo_chain and spo_tree through verl's own advantage step (ray_trainer.compute_advantage)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import compute_advantage

import spo_verl.register  # noqa: F401
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.adapters.estimators import SPOMetadataMissingError

CHAIN_PROBS = [0.99, 0.72, 1.0, 0.85, 1.0, 0.56, 0.92, 0.23, 0.98, 0.11, 1.0]


def batch(rewards, lengths, width, uids):
    response_mask = torch.zeros(len(rewards), width)
    token_level_rewards = torch.zeros(len(rewards), width)
    for row, (reward, length) in enumerate(zip(rewards, lengths)):
        response_mask[row, :length] = 1
        if length:
            token_level_rewards[row, length - 1] = reward
    return DataProto.from_dict(
        tensors={"token_level_rewards": token_level_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def algorithm_config(**spo):
    return OmegaConf.create({"adv_estimator": "spo_tree", "spo": spo})


def test_chain_worked_example_through_verl():
    data = batch([1.0, 0.0], [11, 3], 12, ["u1", "u2"])
    rows = [
        {"segment_starts": [1, 5, 9], "boundary_values": [0.5, 0.25, 0.75]},
        {"segment_starts": [], "boundary_values": []},  # no low-probability token
    ]
    with provide_spo_rows(rows):
        out = compute_advantage(data, "spo_chain", config=algorithm_config())
    expected = [0, -0.25, -0.25, -0.25, -0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0]
    assert out.batch["advantages"][0].tolist() == pytest.approx(expected)
    assert out.batch["advantages"][1].abs().sum() == 0
    assert torch.equal(out.batch["returns"], out.batch["advantages"])


def paper_tree_batch(with_padding=True):
    """The paper's tree as 9 leaf rows: segment of depth 1 is 2 tokens, the leaf segment 3 tokens."""
    leaf_rewards = [1, 0, 1, 1, 1, 1, 0, 0, 0]
    rows = [{"path": [1 + i // 3, 4 + i], "segment_ends": [2, 5]} for i in range(9)]
    uids = ["tree7"] * 9
    rewards, lengths = list(leaf_rewards), [5] * 9
    if with_padding:
        # verl's padding row: all-zero mask, a copy of the first row's metadata, uid "pad<hex>".
        rows.append(dict(rows[0]))
        uids.append("pad3f2a")
        rewards.append(0.0)
        lengths.append(0)
    return batch(rewards, lengths, 6, uids), rows


def test_tree_worked_example_through_verl():
    data, rows = paper_tree_batch()
    with provide_spo_rows(rows) as context:
        out = compute_advantage(data, "spo_tree", config=algorithm_config())
    advantages = out.batch["advantages"]
    # Each segment is trained once: the depth-1 segments by the first leaf under them.
    assert advantages[0, :2].tolist() == pytest.approx([1 / 9] * 2)
    assert advantages[3, :2].tolist() == pytest.approx([4 / 9] * 2)
    assert advantages[6, :2].tolist() == pytest.approx([-5 / 9] * 2)
    for row in (1, 2, 4, 5, 7, 8):
        assert advantages[row, :2].abs().sum() == 0
    assert advantages[0:3, 2:5].tolist() == [pytest.approx([v] * 3) for v in (1 / 3, -2 / 3, 1 / 3)]
    # b's and c's leaves have advantage exactly 0 and are dropped; so is the padding row.
    assert advantages[3:].abs().sum() == pytest.approx(4 / 9 * 2 + 5 / 9 * 2)
    trained = context.trained_mask
    assert trained[:, 5].sum() == 0
    assert trained.sum(dim=1).tolist() == [5, 3, 3, 2, 0, 0, 2, 0, 0, 0]


def test_tree_std_normalize_and_keeping_zero_segments():
    data, rows = paper_tree_batch(with_padding=False)
    with provide_spo_rows(rows) as context:
        out = compute_advantage(data, "spo_tree", config=algorithm_config(tree={"std_normalize": True, "drop_zero_advantage": False}))
    advantages = out.batch["advantages"]
    assert advantages[[0, 3, 6], 0].tolist() == pytest.approx([0.26726, 1.06904, -1.33631], abs=1e-5)
    assert advantages[0:3, 2].tolist() == pytest.approx([0.70711, -1.41421, 0.70711], abs=1e-5)
    # Zero-advantage leaves are kept in the loss when drop_zero_advantage is off.
    assert context.trained_mask.sum(dim=1).tolist() == [5, 3, 3, 5, 3, 3, 5, 3, 3]


def test_tree_early_stopped_node_is_a_leaf():
    # Root children: node 1 stopped at depth 1 (EOS), node 2 has two leaves 3 and 4.
    rows = [{"path": [1], "segment_ends": [2]}, {"path": [2, 3], "segment_ends": [2, 4]}, {"path": [2, 4], "segment_ends": [2, 3]}]
    data = batch([1.0, 0.0, 1.0], [2, 4, 3], 4, ["t"] * 3)
    with provide_spo_rows(rows):
        advantages = compute_advantage(data, "spo_tree", config=algorithm_config()).batch["advantages"]
    # V(2) = 0.5, V(root) = 0.75: A(1) = 0.25, A(2) = -0.25, A(3) = -0.5, A(4) = 0.5.
    assert advantages.tolist() == [
        pytest.approx([0.25, 0.25, 0, 0]),
        pytest.approx([-0.25, -0.25, -0.5, -0.5]),
        pytest.approx([0, 0, 0.5, 0]),
    ]


def test_separate_trees_are_not_mixed():
    rows = [{"path": [1], "segment_ends": [1]}, {"path": [2], "segment_ends": [1]}] * 2
    data = batch([1.0, 0.0, 1.0, 1.0], [1] * 4, 2, ["a", "a", "b", "b"])
    with provide_spo_rows(rows):
        advantages = compute_advantage(data, "spo_tree", config=algorithm_config()).batch["advantages"]
    assert advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


@pytest.mark.parametrize("estimator", ["spo_chain", "spo_tree"])
def test_missing_metadata_names_the_agent_loop_and_trainer(estimator):
    data, _ = paper_tree_batch(with_padding=False)
    with pytest.raises(SPOMetadataMissingError, match=rf"default_agent_loop={estimator}.*SPO recipe"):
        compute_advantage(data, estimator, config=algorithm_config())
    with provide_spo_rows([None] * len(data)), pytest.raises(SPOMetadataMissingError):
        compute_advantage(data, estimator, config=algorithm_config())


def test_inconsistent_tree_metadata_is_rejected():
    rows = [{"path": [1, 3], "segment_ends": [1, 2]}, {"path": [2, 3], "segment_ends": [1, 2]}]
    data = batch([1.0, 0.0], [2, 2], 2, ["t", "t"])
    with provide_spo_rows(rows), pytest.raises(ValueError, match="two different parents"):
        compute_advantage(data, "spo_tree", config=algorithm_config())
    rows = [{"path": [1], "segment_ends": [5]}]
    with provide_spo_rows(rows), pytest.raises(ValueError, match="segment_ends"):
        compute_advantage(batch([1.0], [2], 2, ["t"]), "spo_tree", config=algorithm_config())


def test_invalid_settings_reach_the_user_with_the_key():
    data, rows = paper_tree_batch()
    with provide_spo_rows(rows), pytest.raises(ValueError, match=r"algorithm\.spo\.tree\.std_normalize must be true or false"):
        compute_advantage(data, "spo_tree", config=algorithm_config(tree={"std_normalize": "yes"}))


@pytest.mark.parametrize("estimator", ["spo_chain", "spo_tree"])
def test_empty_batch(estimator):
    fn = get_adv_estimator_fn(estimator)
    with provide_spo_rows([]):
        advantages, returns = fn(
            token_level_rewards=torch.zeros(0, 4), response_mask=torch.zeros(0, 4), index=np.array([], dtype=object),
            config=algorithm_config(),
        )
    assert advantages.shape == (0, 4) and returns.shape == (0, 4)


def test_random_batches_are_finite_and_zero_outside_the_response():
    rng = np.random.default_rng(0)
    for _ in range(20):
        size, width = int(rng.integers(1, 12)), 16
        lengths = rng.integers(0, width + 1, size=size)
        rows = []
        for length in lengths:
            starts = sorted(rng.choice(max(length, 1), size=min(int(rng.integers(0, 4)), length), replace=False).tolist())
            rows.append({"segment_starts": starts, "boundary_values": rng.random(len(starts)).tolist()})
        data = batch(rng.random(size).tolist(), lengths.tolist(), width, [f"u{i}" for i in range(size)])
        with provide_spo_rows(rows):
            advantages = compute_advantage(data, "spo_chain", config=algorithm_config()).batch["advantages"]
        assert torch.isfinite(advantages).all()
        assert (advantages * (1 - data.batch["response_mask"])).abs().sum() == 0


def test_legacy_stand_in_copies_train_nothing():
    # The legacy trainer needs one row per session: a slot under an early-stopped node returns a copy
    # of that leaf marked trains=False, with an all-zero response mask. It must change nothing.
    rows = [
        {"path": [1], "segment_ends": [2]},
        {"path": [1], "segment_ends": [2], "trains": False},
        {"path": [2, 3], "segment_ends": [2, 4]},
        {"path": [2, 4], "segment_ends": [2, 3]},
    ]
    data = batch([1.0, 1.0, 0.0, 1.0], [2, 0, 4, 3], 4, ["t"] * 4)
    with provide_spo_rows(rows) as context:
        advantages = compute_advantage(data, "spo_tree", config=algorithm_config()).batch["advantages"]
    assert advantages[[0, 2, 3]].tolist() == [
        pytest.approx([0.25, 0.25, 0, 0]),
        pytest.approx([-0.25, -0.25, -0.5, -0.5]),
        pytest.approx([0, 0, 0.5, 0]),
    ]
    assert advantages[1].abs().sum() == 0 and not context.trained_mask[1].any()


def test_per_prompt_budget_of_trained_segments():
    from spo_verl.core.algorithms.tree_rows import tree_token_advantages

    _, rows = paper_tree_batch(with_padding=False)
    rewards = torch.tensor([1.0, 0, 1, 1, 1, 1, 0, 0, 0])
    mask = torch.ones(9, 5)
    args = (["p"] * 9, [r["path"] for r in rows], [r["segment_ends"] for r in rows], rewards, mask)
    trainable = {1, 2, 3, 4, 5, 6}  # a, b, c and a's leaves; b's and c's leaves have advantage 0
    seen = set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        result = tree_token_advantages(*args, max_trained_segments_per_tree=2, generator=generator)
        trained_nodes = set()
        for row, meta in enumerate(rows):
            for node, start, end in zip(meta["path"], [0] + meta["segment_ends"][:-1], meta["segment_ends"]):
                if result.trained_mask[row, start:end].any():
                    assert result.trained_mask[row, start:end].all()
                    trained_nodes.add(node)
        assert len(trained_nodes) == 2 and trained_nodes <= trainable
        seen |= trained_nodes
    assert seen == trainable  # every trainable segment can be drawn
    everything = tree_token_advantages(*args, max_trained_segments_per_tree=100)
    assert torch.equal(everything.trained_mask, tree_token_advantages(*args).trained_mask)


def test_budget_reaches_the_estimator_from_the_settings():
    data, rows = paper_tree_batch(with_padding=False)
    with provide_spo_rows(rows) as context:
        compute_advantage(data, "spo_tree", config=algorithm_config(tree={"max_trained_segments_per_prompt": 1}))
    trained_rows = context.trained_mask.any(dim=1).sum().item()
    assert trained_rows == 1


def test_tree_estimator_is_bit_exact_with_the_tree_rows_and_its_errors_name_the_first_bad_row():
    """The estimator's fast reading of the rows (and its one-tree-per-uid check) against the row by
    row version: the benchmark's tree batch with padding and an early-stopped leaf, then bad rows."""
    from spo_verl.core.algorithms.tree_rows import tree_token_advantages
    from spo_workbench.benchmarks.maths import tree_batch

    data = tree_batch(quick=True)
    rows = [dict(row) for row in data.rows]
    rows[3] = dict(rows[3], path=tuple(rows[3]["path"]))  # a tuple path is read as a list
    rows[5] = None  # a padding row
    rows[7] = {k: v for k, v in rows[7].items() if k != "tree_id"}  # tree id from the uid
    index = data.index.copy()
    index[-1] = "pad01"  # verl's padding
    fn = get_adv_estimator_fn("spo_tree")
    config = algorithm_config()
    with provide_spo_rows(rows) as context:
        advantages, returns = fn(token_level_rewards=data.token_level_rewards, response_mask=data.response_mask,
                                 index=index, config=config)
    used = [None if row is None or i == len(rows) - 1 else row for i, row in enumerate(rows)]
    result = tree_token_advantages(
        [None if row is None else row.get("tree_id", index[i]) for i, row in enumerate(used)],
        [None if row is None else list(row["path"]) for row in used],
        [None if row is None else list(row["segment_ends"]) for row in used],
        data.token_level_rewards.sum(-1), data.response_mask)
    expected = result.token_advantages.masked_fill_(~result.trained_mask, 0.0)
    assert advantages is returns
    assert torch.equal(advantages.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(context.trained_mask, result.trained_mask)
    assert context.tree_nodes.paths[3] == list(rows[3]["path"]) and context.tree_nodes.paths[5] is None

    def call(bad_rows, uids=data.index):
        with provide_spo_rows(bad_rows):
            fn(token_level_rewards=data.token_level_rewards, response_mask=data.response_mask, index=uids,
               config=config)

    missing = [dict(row) for row in data.rows]
    del missing[4]["segment_ends"]
    missing[6] = dict(missing[6], tree_id=None)
    with pytest.raises(SPOMetadataMissingError, match=r"no 'segment_ends'"):
        call(missing)
    missing[2] = {k: v for k, v in missing[2].items() if k != "path"}
    with pytest.raises(SPOMetadataMissingError, match=r"no 'path'"):
        call(missing)
    with pytest.raises(ValueError, match=r"spo_tree row 0: no tree_id in its metadata and no uid to group by"):
        call([{k: v for k, v in row.items() if k != "tree_id"} for row in data.rows], uids=None)
    split = [dict(row) for row in data.rows]
    split[1] = dict(split[1], tree_id="elsewhere", path=[99])
    with pytest.raises(ValueError, match=rf"uid={data.index[1]} come from 2 different trees"):
        call(split)
