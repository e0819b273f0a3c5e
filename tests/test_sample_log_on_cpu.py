"""The sample log (algorithm.spo.diagnostics.sample_log): exact tree values and advantages, segment bounds, and
probability-mask flags of the responses it writes, for spo_tree, spo_chain and the plain baselines."""

import json
import math

import numpy as np
import pytest
import torch

from spo_verl.core.metadata import TreeLeafRow
from omegaconf import OmegaConf

from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.core.config import SPOConfigError, parse_spo_settings
from spo_verl.adapters.settings import spo_settings
from spo_verl.adapters.estimators import compute_spo_chain_advantage, compute_spo_tree_advantage
from spo_verl.adapters.trainer.batch_view import SampledResponse
from spo_verl.adapters.trainer.sample_log import choose_rows, step_record


class CharTokenizer:
    """Token id i is the letter chr(97 + i % 26): decoded text is easy to predict."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def algorithm(estimator, **spo):
    return OmegaConf.create({"adv_estimator": estimator, "spo": spo})


# A 2-2 tree: root -> a (node 1), b (node 2); a -> 3, 4; b -> 5, 6. Leaf rewards 1, 0, 1, 1.
TREE_ROWS = [
    {"tree_id": "t", "path": [1, 3], "segment_ends": [2, 4], "trains": True},
    {"tree_id": "t", "path": [1, 4], "segment_ends": [2, 5], "trains": True},
    {"tree_id": "t", "path": [2, 5], "segment_ends": [3, 4], "trains": True},
    {"tree_id": "t", "path": [2, 6], "segment_ends": [3, 5], "trains": True},
]
TREE_REWARDS = [1.0, 0.0, 1.0, 1.0]
TREE_LENGTHS = [4, 5, 4, 5]
WIDTH = 5


def tree_batch():
    response_mask = torch.zeros(4, WIDTH)
    rewards = torch.zeros(4, WIDTH)
    for b, (length, reward) in enumerate(zip(TREE_LENGTHS, TREE_REWARDS)):
        response_mask[b, :length] = 1
        rewards[b, length - 1] = reward
    return rewards, response_mask


def sampled(b, row, length, advantages, trained, score, log_probs=None, response_mask=None, episode=None):
    return SampledResponse(
        batch_index=b, uid="u", row=row, prompt_ids=[0, 1], response_ids=list(range(10 + b, 10 + b + length)),
        log_probs=torch.full((length,), math.log(0.5)) if log_probs is None else log_probs,
        response_mask=torch.ones(length) if response_mask is None else response_mask,
        advantages=advantages[:length], trained=trained[:length], score=score, episode=episode,
    )


def test_sample_log_settings_defaults_and_validation():
    settings = parse_spo_settings(None).diagnostics.sample_log
    assert settings.dir is None and settings.responses_per_step == 4
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.diagnostics\.sample_log\.responses_per_step must be a positive integer"):
        parse_spo_settings({"diagnostics": {"sample_log": {"responses_per_step": 0}}})
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.diagnostics\.sample_log\.dir must be a non-empty string or null"):
        parse_spo_settings({"diagnostics": {"sample_log": {"dir": ""}}})


def test_tree_record_has_the_estimators_values_and_advantages():
    rewards, response_mask = tree_batch()
    config = algorithm("spo_tree")
    with provide_spo_rows(TREE_ROWS) as context:
        advantages, _ = compute_spo_tree_advantage(rewards, response_mask, index=np.array(["u"] * 4), config=config)
    chosen = choose_rows("spo_tree", ["u"] * 4, TREE_LENGTHS, 4, rows=TREE_ROWS, tree_nodes=context.tree_nodes)
    assert chosen == [0, 1, 2, 3]  # spo_tree: every leaf of the tree, whatever responses_per_step
    trained = context.trained_mask & response_mask.bool()
    responses = [sampled(b, TREE_ROWS[b], TREE_LENGTHS[b], advantages[b], trained[b], TREE_REWARDS[b]) for b in chosen]
    record = step_record(7, config.adv_estimator, "spo_prob_mask", responses, CharTokenizer(), spo_settings(config), tree_nodes=context.tree_nodes)
    json.dumps(record)  # plain JSON
    assert (record["step"], record["algorithm"], record["loss_mode"]) == (7, "spo_tree", "spo_prob_mask")
    assert record["prob_mask_threshold"] == 0.9 and record["prob_mask_applied"] is True

    nodes = {node["id"]: node for node in record["tree"]["nodes"]}
    assert list(nodes) == ["root", "1", "2", "3", "4", "5", "6"]
    expected = {  # id: (parent, depth, V, A, leaf reward)
        "root": (None, 0, 0.75, None, None),
        "1": ("root", 1, 0.5, -0.25, None), "2": ("root", 1, 1.0, 0.25, None),
        "3": ("1", 2, 1.0, 0.5, 1.0), "4": ("1", 2, 0.0, -0.5, 0.0),
        "5": ("2", 2, 1.0, 0.0, 1.0), "6": ("2", 2, 1.0, 0.0, 1.0),
    }
    for node_id, (parent, depth, value, advantage, reward) in expected.items():
        node = nodes[node_id]
        assert (node["parent"], node["depth"]) == (parent, depth)
        assert node["value"] == pytest.approx(value) and node["reward"] == reward
        assert node["advantage"] == (None if advantage is None else pytest.approx(advantage))
    # Segment texts: node 1 is tokens 0-1 of leaf row 0 (ids 10, 11), node 4 tokens 2-4 of row 1 (ids 13-15).
    assert nodes["1"]["text"] == "kl" and nodes["4"]["text"] == "nop" and nodes["root"]["text"] == "ab"
    assert nodes["4"]["response"] == 1 and nodes["1"]["response"] is None
    # Zero-advantage leaves are not trained; every other segment is, by one row.
    assert [nodes[n]["trained"] for n in ["1", "2", "3", "4", "5", "6"]] == [True, True, True, True, False, False]

    leaf = record["responses"][1]
    assert [(s["start"], s["end"], s["node"]) for s in leaf["segments"]] == [(0, 2, "1"), (2, 5, "4")]
    assert leaf["segments"][1]["advantage"] == pytest.approx(-0.5)
    assert leaf["segments"][1]["value_before"] == pytest.approx(0.5) and leaf["segments"][1]["value_after"] == 0.0
    assert leaf["tokens"] == ["l", "m", "n", "o", "p"] and leaf["score"] == 0.0
    # Row 1 shares node 1 with row 0, which trains it: row 1 trains only its own leaf segment.
    assert leaf["trained"] == [0, 0, 1, 1, 1]
    assert leaf["advantages"] == pytest.approx([0, 0, -0.5, -0.5, -0.5])


def test_probability_mask_flags_follow_the_threshold():
    probs = torch.tensor([0.95, 0.9, 0.89, 0.2, 0.5])
    log_probs = probs.log()
    response = sampled(0, None, 5, torch.full((5,), 0.7), torch.ones(5, dtype=torch.bool), 1.0, log_probs=log_probs)
    grpo = algorithm("grpo", prob_mask={"threshold": 0.9})
    record = step_record(1, grpo.adv_estimator, "spo_prob_mask", [response], CharTokenizer(), spo_settings(grpo))
    logged = record["responses"][0]
    expected = (log_probs.exp() < 0.9).int().tolist()  # p_old < threshold, as the loss masks
    assert logged["in_prob_mask"] == expected and expected[2:] == [1, 1, 1] and expected[0] == 0
    assert logged["probs"] == pytest.approx(probs.tolist(), abs=1e-6)
    # A plain response is one segment with its (GRPO) advantage.
    assert logged["segments"] == [{"start": 0, "end": 5, "advantage": pytest.approx(0.7), "value_before": None,
                                   "value_after": None, "cutpoint": False, "node": None, "trained": True}]
    grpo = algorithm("grpo", prob_mask={"threshold": 0.5})
    plain = step_record(1, grpo.adv_estimator, "vanilla", [response], CharTokenizer(), spo_settings(grpo))
    assert plain["prob_mask_applied"] is False and plain["responses"][0]["in_prob_mask"] == [0, 0, 0, 1, 0]


def test_chain_segments_from_the_worked_example():
    """the paper: p as given, cutpoints int2 at 1, 5, 9, V = [.5, .25, .75], R = 1."""
    probs = torch.tensor([0.99, 0.72, 1.0, 0.85, 1.0, 0.56, 0.92, 0.23, 0.98, 0.11, 1.0])
    row = {"segment_starts": [1, 5, 9], "boundary_values": [0.5, 0.25, 0.75], "truncated": False}
    rewards = torch.zeros(1, 11)
    rewards[0, -1] = 1.0
    config = algorithm("spo_chain")
    with provide_spo_rows([row]):
        advantages, _ = compute_spo_chain_advantage(rewards, torch.ones(1, 11), index=np.array(["c"]), config=config)
    response = sampled(0, row, 11, advantages[0], torch.ones(11, dtype=torch.bool), 1.0, log_probs=probs.log())
    logged = step_record(2, config.adv_estimator, "spo_prob_mask", [response], CharTokenizer(), spo_settings(config))["responses"][0]
    segments = [(s["start"], s["end"], s["advantage"], s["value_before"], s["value_after"], s["cutpoint"])
                for s in logged["segments"]]
    assert segments == [
        (0, 1, 0.0, None, None, False),  # the head before the first cutpoint
        (1, 5, pytest.approx(-0.25), 0.5, 0.25, True),
        (5, 9, pytest.approx(0.5), 0.25, 0.75, True),
        (9, 11, pytest.approx(0.25), 0.75, 1.0, True),
    ]
    assert logged["in_prob_mask"] == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    assert logged["boundary_values"] == [0.5, 0.25, 0.75]


def test_a_truncated_chain_response_ends_at_r_zero():
    row = {"segment_starts": [0], "boundary_values": [0.5], "truncated": True}
    response = sampled(0, row, 3, torch.full((3,), -0.5), torch.ones(3, dtype=torch.bool), 1.0)
    chain = algorithm("spo_chain")
    logged = step_record(1, chain.adv_estimator, "spo_prob_mask", [response], CharTokenizer(), spo_settings(chain))["responses"][0]
    assert [(s["start"], s["value_after"]) for s in logged["segments"]] == [(0, 0.0)]  # no head: the cut is token 0


def test_choose_rows_skips_padding_and_takes_one_row_per_prompt_first():
    uids = ["a", "a", "a", "pad1", "b", "b", "c"]
    lengths = [3, 3, 3, 3, 0, 4, 2]
    assert choose_rows("grpo", uids, lengths, 4) == [0, 5, 6, 1]
    assert choose_rows("grpo", uids, lengths, 2, padding=[True] + [False] * 6) == [1, 5]
    # The legacy trainer's stand-in copy of a leaf, as the agent loop writes it (a dict) and as read.
    stand_in = {"path": [1], "segment_ends": [3], "trains": False}
    for row in (stand_in, TreeLeafRow(path=[1], segment_ends=[3], trains=False)):
        assert choose_rows("grpo", uids, lengths, 1, rows=[row, *[None] * 6]) == [1]


def test_an_unwritable_folder_does_not_stop_training(tmp_path, caplog):
    from spo_verl.adapters.trainer.sample_log import log_step

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    config = OmegaConf.create({"algorithm": {"adv_estimator": "grpo", "spo": {"diagnostics": {"sample_log": {"dir": str(blocker / "x")}}}}})
    fetch = lambda chosen: [sampled(i, None, 2, torch.zeros(2), torch.ones(2, dtype=torch.bool), 0.0) for i in chosen]  # noqa: E731
    assert log_step(1, config.algorithm.adv_estimator, "vanilla", CharTokenizer(), ["u"], [2], fetch, spo_settings(config.algorithm)) is None
    assert "sample log: could not write step 1" in caplog.text
    config.algorithm.spo.diagnostics.sample_log.dir = None
    assert log_step(1, config.algorithm.adv_estimator, "vanilla", CharTokenizer(), ["u"], [2], lambda chosen: pytest.fail("fetched while off"),
                    spo_settings(config.algorithm)) is None


def test_an_episode_logs_which_tokens_are_the_environments_and_how_it_ended():
    """SPO-chain over turns: turn 1 (tokens 0-2), the environment's reply (3-4, out of verl's
    response_mask), turn 2 (5-6); V before the turns 0.25 and 0.5, R = 1."""
    episode = {"turns": 2, "reply_tokens": 2, "ended_by": "environment", "environment_error": None}
    row = {"segment_starts": [0, 5], "boundary_values": [0.25, 0.5], "truncated": False}
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    rewards = torch.zeros(1, 7)
    rewards[0, -1] = 1.0
    config = algorithm("spo_chain", chain={"partition": "turn"}, turns={"environment": "arithmetic_dialogue"})
    with provide_spo_rows([row]):
        advantages, _ = compute_spo_chain_advantage(rewards, response_mask, index=np.array(["e"]), config=config)
    response = sampled(0, row, 7, advantages[0], response_mask[0].bool(), 1.0, response_mask=response_mask[0], episode=episode)
    logged = step_record(1, config.adv_estimator, "spo_prob_mask", [response], CharTokenizer(), spo_settings(config))["responses"][0]
    assert logged["environment"] == [0, 0, 0, 1, 1, 0, 0]
    assert logged["episode"] == episode
    assert logged["advantages"] == pytest.approx([0.25] * 3 + [0.0] * 2 + [0.5] * 2)
    assert logged["in_prob_mask"] == [1, 1, 1, 0, 0, 1, 1]  # p = 0.5 < 0.9, and the reply is out of the mask
    assert [(s["start"], s["end"], s["value_before"], s["value_after"]) for s in logged["segments"]] == [(0, 5, 0.25, 0.5), (5, 7, 0.5, 1.0)]
    plain = step_record(1, config.adv_estimator, "spo_prob_mask", [sampled(0, None, 3, torch.zeros(3), torch.ones(3, dtype=torch.bool), 0.0)],
                        CharTokenizer(), spo_settings(config))["responses"][0]
    assert "environment" not in plain and "episode" not in plain  # single-turn responses carry neither
