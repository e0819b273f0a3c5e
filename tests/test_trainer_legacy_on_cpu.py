"""SPO on verl's legacy trainer (trainer.use_v1=false): the batch's `spo` column reaches the estimator
inside RayPPOTrainer.fit, and the loss is narrowed to the trained segments."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer import main_ppo_v0
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

import verl.trainer.ppo.ray_trainer as ray_trainer_module
from spo_verl.estimators import SPOMetadataMissingError
from spo_verl.trainer.legacy import SPO_METRICS_KEY, SPORayPPOTrainer, compute_advantage_with_spo_rows, spo_advantage_hook
from spo_verl.trainer.runners import _SPOLegacyTaskRunner

ALGORITHM = OmegaConf.create({"adv_estimator": "spo_tree", "spo": {}})


def legacy_batch(rows, rewards, lengths, width, uids):
    """What verl's AgentLoopWorker hands the legacy trainer: padded tensors, extra_fields as columns."""
    response_mask = torch.zeros(len(rows), width)
    token_level_rewards = torch.zeros(len(rows), width)
    for b, (reward, length) in enumerate(zip(rewards, lengths)):
        response_mask[b, :length] = 1
        token_level_rewards[b, max(length - 1, 0)] = reward
    spo_column = np.empty(len(rows), dtype=object)
    spo_column[:] = rows
    return DataProto.from_dict(
        tensors={"token_level_rewards": token_level_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.array(uids, dtype=object), "spo": spo_column},
    )


def test_spo_column_reaches_the_estimator_and_narrows_the_loss_mask():
    rows = [
        {"tree_id": "t", "path": [1], "segment_ends": [2], "trains": True},
        {"tree_id": "t", "path": [1], "segment_ends": [2], "trains": False},  # stand-in for a merged slot
        {"tree_id": "t", "path": [2, 3], "segment_ends": [2, 4], "trains": True},
        {"tree_id": "t", "path": [2, 4], "segment_ends": [2, 3], "trains": True},
    ]
    data = legacy_batch(rows, [1.0, 1.0, 0.0, 1.0], [2, 2, 4, 3], 4, ["t"] * 4)
    data.batch["response_mask"][1] = 0  # the stand-in's mask is all zero
    out = compute_advantage_with_spo_rows(data, "spo_tree", config=ALGORITHM)
    assert out.batch["advantages"].tolist() == [
        pytest.approx([0.25, 0.25, 0, 0]),
        [0.0] * 4,
        pytest.approx([-0.25, -0.25, -0.5, -0.5]),
        pytest.approx([0, 0, 0.5, 0]),
    ]
    # Row 3 shares node 2 with row 2, which trains it; zero-advantage and padding tokens stay out.
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]]
    metrics = out.meta_info[SPO_METRICS_KEY]
    assert metrics["spo/trained_token_fraction"] == pytest.approx(7 / 9)
    assert metrics["spo/tree/advantage_abs_mean/depth1"] == pytest.approx(0.25)


def test_non_spo_estimators_are_verls_unchanged():
    data = legacy_batch([None] * 4, [1.0, 0.0, 1.0, 0.0], [3] * 4, 3, ["g"] * 4)
    before = data.batch["response_mask"].clone()
    out = compute_advantage_with_spo_rows(data, "grpo", config=OmegaConf.create({"adv_estimator": "grpo"}))
    assert torch.equal(out.batch["response_mask"], before)
    assert SPO_METRICS_KEY not in out.meta_info


def test_missing_column_fails_with_the_fix():
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)},
        non_tensors={"uid": np.array(["u", "u"], dtype=object)},
    )
    with pytest.raises(SPOMetadataMissingError, match="default_agent_loop=spo_tree"):
        compute_advantage_with_spo_rows(data, "spo_tree", config=ALGORITHM)


def test_the_hook_is_what_fit_calls_and_is_undone_afterwards():
    # RayPPOTrainer.fit looks compute_advantage up in its module's globals at call time.
    assert RayPPOTrainer.fit.__globals__ is vars(ray_trainer_module)
    original = ray_trainer_module.compute_advantage
    with spo_advantage_hook():
        assert RayPPOTrainer.fit.__globals__["compute_advantage"] is compute_advantage_with_spo_rows
    assert ray_trainer_module.compute_advantage is original


def test_legacy_task_runner_builds_the_spo_trainer(monkeypatch):
    built = {}

    def verl_run(self, config):
        built["trainer"] = main_ppo_v0.RayPPOTrainer  # what verl's TaskRunner.run instantiates

    monkeypatch.setattr(main_ppo_v0.TaskRunner.__ray_actor_class__, "run", verl_run)
    _SPOLegacyTaskRunner.run(object.__new__(_SPOLegacyTaskRunner), OmegaConf.create({}))
    assert built["trainer"] is SPORayPPOTrainer
    assert main_ppo_v0.RayPPOTrainer is RayPPOTrainer
