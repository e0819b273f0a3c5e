"""Where SPO's agent loops and trainers meet verl's dispatch: weight versions, aborted requests,
validation, a prompt split over workers, per-row session counts. The end-to-end tests run the
normal path through verl's trainer; these cover the cases a normal run does not produce (an
aborted request is injected by a scripted ``generate``, the one stand-in here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.workers.rollout.replica import TokenOutput

import spo_verl.register  # noqa: F401
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.core.rollout.chain import monte_carlo_value
from spo_verl.core.rollout.server_output import AbortedGeneration, merged_weight_versions
from spo_verl.core.rollout.tree import sample_tree
from spo_verl.adapters.trainer.plain_validation import VALIDATION_AGENT_LOOP, PlainValidationBatches, plain_validation
from spo_verl.adapters.trainer.v1 import check_no_per_row_rollout_n


def test_a_trajectory_spans_the_oldest_and_newest_weights_it_was_generated_with():
    segments = [
        {"global_steps": 4, "min_global_steps": 3, "max_global_steps": 4, "num_cached_tokens": 0},
        {"global_steps": 5, "min_global_steps": 5, "max_global_steps": 5},
    ]
    assert merged_weight_versions(segments) == {"global_steps": 5, "min_global_steps": 3, "max_global_steps": 5}
    assert merged_weight_versions([{"global_steps": 2}]) == {"global_steps": 2, "min_global_steps": 2, "max_global_steps": 2}
    assert merged_weight_versions([{}]) == {}


def scripted_generate(outputs):
    calls = iter(outputs)

    async def generate(request_id, *, prompt_ids, sampling_params, **kwargs):
        return next(calls)

    return generate


def test_an_aborted_tree_segment_is_an_error_not_a_short_segment():
    finished = TokenOutput(token_ids=[5, 6, 7], log_probs=[-0.1, -0.2, -0.3], stop_reason="completed")
    aborted = TokenOutput(token_ids=[5], log_probs=[-0.1], stop_reason="aborted")
    generate = scripted_generate([finished, aborted])
    with pytest.raises(AbortedGeneration, match="aborted a tree segment request"):
        asyncio.run(sample_tree(generate, "tree", [1, 2], {}, branching=[2], segment_budgets=[],
                                response_length=8, eos_token_ids={3}))


def test_an_aborted_monte_carlo_continuation_is_an_error():
    aborted = TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted")

    async def score(response_ids):
        return 1.0

    with pytest.raises(AbortedGeneration, match="Monte Carlo continuation"):
        asyncio.run(monte_carlo_value(scripted_generate([aborted, aborted]), "r", [1], [2], {}, 2, 8, score, {3}, False))


def test_leaves_of_two_trees_under_one_uid_are_refused():
    # A prompt whose sessions ran on two workers: two trees, both numbering their nodes from 1.
    rows = [{"tree_id": tree, "path": [1, 2], "segment_ends": [1, 2]} for tree in ("a", "a", "b", "b")]
    mask = torch.ones(4, 2)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array(["p1"] * 4, dtype=object)})
    with provide_spo_rows(rows), pytest.raises(ValueError, match=r"uid=p1 come from 2 different trees.*num_workers"):
        compute_advantage(data, "spo_tree", config=OmegaConf.create({"adv_estimator": "spo_tree", "spo": {}}))


def validation_batches():
    return [
        {"raw_prompt": np.array([[{"role": "user", "content": "a"}]] * 2, dtype=object)},
        {"raw_prompt": np.array([["x"], ["y"], ["z"]], dtype=object),
         "agent_name": np.array(["spo_tree", "tool_agent", "spo_chain"], dtype=object)},
    ]


def test_validation_batches_name_the_single_turn_loop_instead_of_spo_loops():
    batches = list(PlainValidationBatches(validation_batches()))
    assert batches[0]["agent_name"].tolist() == [VALIDATION_AGENT_LOOP] * 2
    # A row that names another loop keeps it; rows that name an SPO loop validate with the plain loop.
    assert batches[1]["agent_name"].tolist() == [VALIDATION_AGENT_LOOP, "tool_agent", VALIDATION_AGENT_LOOP]
    assert len(PlainValidationBatches(validation_batches())) == 2


@pytest.mark.parametrize(("agent_loop", "wrapped"), [("spo_tree", True), ("spo_chain", True), ("single_turn_agent", False)])
def test_plain_validation_applies_to_spo_loops_only(agent_loop, wrapped):
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": agent_loop}}}})
    trainer = SimpleNamespace(config=config, val_dataloader=validation_batches())
    plain_validation(trainer)
    assert isinstance(trainer.val_dataloader, PlainValidationBatches) == wrapped


def test_a_multi_turn_run_validates_by_playing_episodes():
    """SPO-chain over turns validates through spo_episode (one episode a prompt, no values); verl's
    estimators on spo_episode keep it, as the rollout's own loop."""
    over_turns = OmegaConf.create({"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": "spo_chain"}}},
                                   "algorithm": {"spo": {"chain": {"partition": "turn"}}}})
    trainer = SimpleNamespace(config=over_turns, val_dataloader=validation_batches())
    plain_validation(trainer)
    batches = list(trainer.val_dataloader)
    assert batches[0]["agent_name"].tolist() == ["spo_episode"] * 2
    assert batches[1]["agent_name"].tolist() == ["spo_episode", "tool_agent", "spo_episode"]
    baseline = OmegaConf.create({"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": "spo_episode"}}}})
    trainer = SimpleNamespace(config=baseline, val_dataloader=validation_batches())
    plain_validation(trainer)
    assert not isinstance(trainer.val_dataloader, PlainValidationBatches)


def test_a_per_row_session_count_is_refused_for_spo_tree():
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"agent": {"default_agent_loop": "spo_tree"}}}})
    dataset = SimpleNamespace(dataframe=SimpleNamespace(column_names=["prompt", "__rollout_n__"]))
    with pytest.raises(ValueError, match=r"__rollout_n__ column.*actor_rollout_ref\.rollout\.n"):
        check_no_per_row_rollout_n(config, dataset)
    check_no_per_row_rollout_n(config, SimpleNamespace(dataframe=SimpleNamespace(column_names=["prompt"])))
    config.actor_rollout_ref.rollout.agent.default_agent_loop = "single_turn_agent"
    check_no_per_row_rollout_n(config, dataset)
