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
from spo_verl.trainer.legacy import (
    GENERATED_TOKENS_KEY,
    SPO_METRICS_KEY,
    SPORayPPOTrainer,
    compute_advantage_with_spo_rows,
    spo_advantage_hook,
)
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
    assert out.meta_info[GENERATED_TOKENS_KEY] == 12  # 4 responses of 3 tokens


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


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def after_old_log_probs(rows, rewards, lengths, width, uids):
    """A legacy batch as compute_advantage gets it in fit: left-padded prompts (width 3), scores, p_old."""
    data = legacy_batch(rows, rewards, lengths, width, uids)
    batch_size = len(rows)
    data.batch["prompts"] = torch.tensor([[0, 5, 6]] * batch_size)
    data.batch["attention_mask"] = torch.cat([torch.tensor([[0, 1, 1]] * batch_size), data.batch["response_mask"].long()], 1)
    data.batch["responses"] = torch.arange(batch_size * width).reshape(batch_size, width) % 20 + 1
    data.batch["token_level_scores"] = data.batch["token_level_rewards"].clone()
    data.batch["old_log_probs"] = torch.full((batch_size, width), float(np.log(0.5)))
    return data


def logging_trainer(directory, estimator, loss_mode="spo_prob_mask"):
    trainer = object.__new__(SPORayPPOTrainer)  # no workers: fit's advantage call only
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
                      "spo": {"sample_log": {"dir": str(directory), "responses_per_step": 2}}},
        "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": loss_mode}}},
    })
    trainer.tokenizer, trainer.global_steps = CharTokenizer(), 3
    return trainer


def fit_advantage_call(trainer, data, num_repeat):
    """The call RayPPOTrainer.fit makes, under the hook SPORayPPOTrainer.fit installs."""
    algorithm = trainer.config.algorithm
    with spo_advantage_hook(trainer):
        return ray_trainer_module.compute_advantage(
            data, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
            num_repeat=num_repeat, norm_adv_by_std_in_grpo=True, config=algorithm)


def test_fit_writes_the_tree_of_a_step_to_the_sample_log(tmp_path):
    from spo_verl.trainer.sample_log import SAMPLES_FILE, read_records

    rows = [
        {"tree_id": "t", "path": [1, 3], "segment_ends": [2, 4], "trains": True},
        {"tree_id": "t", "path": [1, 4], "segment_ends": [2, 5], "trains": True},
        {"tree_id": "t", "path": [1, 4], "segment_ends": [2, 5], "trains": False},  # a stand-in copy
        {"tree_id": "t", "path": [2, 5], "segment_ends": [3, 4], "trains": True},
        {"tree_id": "t", "path": [2, 6], "segment_ends": [3, 5], "trains": True},
    ]
    data = after_old_log_probs(rows, [1.0, 0.0, 0.0, 1.0, 1.0], [4, 5, 5, 4, 5], 5, ["u"] * 5)
    data.batch["response_mask"][2] = 0
    out = fit_advantage_call(logging_trainer(tmp_path, "spo_tree"), data, num_repeat=5)
    assert out.batch["response_mask"].sum(dim=1).tolist() == [4, 3, 0, 3, 0]  # narrowed to the trained segments after logging
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["step"] == 3 and len(record["responses"]) == 4  # the stand-in is not a leaf of its own
    assert {n["id"]: n["value"] for n in record["tree"]["nodes"]} == pytest.approx(
        {"root": 0.75, "1": 0.5, "2": 1.0, "3": 1.0, "4": 0.0, "5": 1.0, "6": 1.0})
    assert record["responses"][0]["prompt"] == "fg"  # left padding dropped
    assert record["responses"][1]["trained"] == [0, 0, 1, 1, 1]


def test_fit_logs_baseline_samples_without_spo_metrics(tmp_path):
    from spo_verl.trainer.sample_log import SAMPLES_FILE, read_records

    data = after_old_log_probs([None] * 4, [1.0, 0.0, 1.0, 0.0], [3, 3, 2, 3], 3, ["g", "g", "h", "h"])
    out = fit_advantage_call(logging_trainer(tmp_path, "grpo", loss_mode="vanilla"), data, num_repeat=2)
    assert SPO_METRICS_KEY not in out.meta_info
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["algorithm"] == "grpo" and record["prob_mask_applied"] is False
    assert [r["uid"] for r in record["responses"]] == ["g", "h"]  # one per prompt first
    assert [len(r["tokens"]) for r in record["responses"]] == [3, 2]
    assert record["responses"][0]["advantages"] == pytest.approx(out.batch["advantages"][0].tolist(), abs=1e-6)


def test_without_a_sample_log_dir_fit_calls_the_plain_hook():
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": "grpo"}})
    with spo_advantage_hook(trainer):
        assert RayPPOTrainer.fit.__globals__["compute_advantage"] is compute_advantage_with_spo_rows


@pytest.mark.parametrize("packed", [True, False])
def test_packed_training_keeps_each_uid_on_one_rank(packed):
    """verl's legacy balancing spreads rows over data-parallel ranks by length; with packed training
    each uid's rows (a prompt's responses) stay together on one rank, so they pack."""
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"spo": {"packed_training": packed}},
                                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}}})
    trainer.actor_rollout_wg = None
    trainer._get_dp_size = lambda group, role: 2
    uids = ["a", "b", "c", "d"] * 3  # interleaved, as the rollout returns them
    lengths = torch.tensor([3, 9, 5, 7, 8, 2, 6, 4, 5, 5, 9, 1])
    attention_mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    batch = DataProto.from_dict(tensors={"attention_mask": attention_mask},
                                non_tensors={"uid": np.array(uids, dtype=object)})
    metrics = {}
    trainer._balance_batch(batch, metrics)
    ranks = [list(batch.non_tensor_batch["uid"][:6]), list(batch.non_tensor_batch["uid"][6:])]
    kept_together = all(len(set(rank)) == 2 and all(rank.count(u) == 3 for u in set(rank)) for rank in ranks)
    contiguous = all(rank[i] == rank[i - 1] or rank[i] not in rank[:i] for rank in ranks for i in range(1, 6))
    assert (kept_together and contiguous) == packed, ranks
    assert not getattr(trainer, "use_prefix_grouper", False)  # set for the call only
    assert "global_seqlen/mean" in metrics
