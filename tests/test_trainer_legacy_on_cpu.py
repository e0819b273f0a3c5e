"""SPO on verl's legacy trainer (trainer.use_v1=false): verl's advantage step inside fit gets a
placeholder, the SPO trainer's actor update computes the advantages with the batch's `spo` column and
narrows the loss to the trained segments. The whole loop runs in tests/test_end_to_end_on_cpu.py
(legacy-spo_tree, legacy-spo_chain)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer import main_ppo_v0
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from verl.trainer.ppo.ray_trainer import compute_advantage

from spo_verl.adapters.advantage_channel import advantages_at_actor_update, advantages_deferred
from spo_verl.core.metadata import EPISODE_FIELD
from spo_verl.adapters.estimators import SPOMetadataMissingError
from spo_verl.adapters.trainer.legacy import SPORayPPOTrainer
from spo_verl.adapters.trainer.runners import _SPOLegacyTaskRunner


def algorithm(estimator="spo_tree", **spo):
    return OmegaConf.create({"adv_estimator": estimator, "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
                             "spo": spo})


ALGORITHM = algorithm()


def run_spo_step(data, algorithm_config, rollout_n, trainer=None):
    """SPO's step on a legacy batch as ``SPORayPPOTrainer._update_actor`` runs it before verl's update,
    for a trainer without workers (its sample log and credit settings, tokenizer and step where given).
    Returns the step's metrics."""
    if trainer is None:
        trainer = object.__new__(SPORayPPOTrainer)
        trainer.config = OmegaConf.create({})
    trainer.config = OmegaConf.merge({"algorithm": algorithm_config, "actor_rollout_ref": {"rollout": {"n": rollout_n}}},
                                     trainer.config)
    trainer.init_spo_state(trainer.config)  # what the constructor does after verl's
    for name, value in {"tokenizer": None, "global_steps": 1, "total_training_steps": 1}.items():
        trainer.__dict__.setdefault(name, value)  # what verl's constructor and fit set before a step
    return trainer._spo_step_in_place(data).metrics


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
    metrics = run_spo_step(data, ALGORITHM, rollout_n=4)
    out = data  # in place: fit's batch object
    assert out.batch["advantages"].tolist() == [
        pytest.approx([0.25, 0.25, 0, 0]),
        [0.0] * 4,
        pytest.approx([-0.25, -0.25, -0.5, -0.5]),
        pytest.approx([0, 0, 0.5, 0]),
    ]
    # Row 3 shares node 2 with row 2, which trains it; zero-advantage and padding tokens stay out.
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]]
    assert metrics["spo/generated_tokens"] == 9  # the rows' response tokens (a stand-in's mask is 0)
    assert metrics["spo/trained_token_fraction"] == pytest.approx(7 / 9) and metrics["spo/trained_tokens"] == 7
    assert metrics["spo/tree/advantage_abs_mean/depth1"] == pytest.approx(0.25)


def test_non_spo_estimators_are_verls_unchanged():
    data = legacy_batch([None] * 4, [1.0, 0.0, 1.0, 0.0], [3] * 4, 3, ["g"] * 4)
    grpo = algorithm("grpo")
    data = compute_advantage(data, adv_estimator="grpo", num_repeat=4, config=grpo)  # fit's own step
    before = {key: data.batch[key].clone() for key in ("response_mask", "advantages")}
    metrics = run_spo_step(data, grpo, rollout_n=4)
    assert all(torch.equal(data.batch[key], value) for key, value in before.items())
    assert metrics == {"spo/generated_tokens": 12, "spo/generated_tokens_cumulative": 12}  # 4 responses of 3 tokens
    # Episodes played by spo_episode arrive as the spo_turns column: their spo/turns/* for GRPO too.
    episode = {"turns": 2, "reply_tokens": 1, "ended_by": "environment", "environment_error": None}
    data.non_tensor_batch["spo_turns"] = np.array([episode, episode, {**episode, "ended_by": "length"}, None], dtype=object)
    assert run_spo_step(data, grpo, rollout_n=4) == {
        "spo/generated_tokens": 12, "spo/generated_tokens_cumulative": 12, "spo/turns/turns_per_episode": 2.0, "spo/turns/reply_tokens_per_episode": 1.0,
        "spo/turns/ended_by_environment_fraction": pytest.approx(2 / 3), "spo/turns/environment_errors": 0.0}


def test_fit_defers_the_spo_step_to_the_actor_update(monkeypatch):
    """verl's advantage step in fit has no SPO rows: inside SPORayPPOTrainer.fit an SPO estimator gives
    zeros there; outside it, the same call fails with the fix."""
    rows = [{"tree_id": "t", "path": [1], "segment_ends": [2], "trains": True},
            {"tree_id": "t", "path": [2], "segment_ends": [2], "trains": True}]
    seen = {}

    def verl_fit(trainer):
        seen["deferred"] = advantages_deferred()
        data = legacy_batch([None, None], [1.0, 0.0], [2, 2], 2, ["t", "t"])
        estimator = trainer.config.algorithm.adv_estimator
        seen["advantages"] = compute_advantage(data, adv_estimator=estimator, num_repeat=2,
                                               config=trainer.config.algorithm).batch["advantages"]

    monkeypatch.setattr(RayPPOTrainer, "fit", verl_fit)
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": ALGORITHM})
    trainer.fit()
    assert seen["deferred"] and torch.equal(seen["advantages"], torch.zeros(2, 2))
    assert not advantages_deferred()
    trainer.config = OmegaConf.create({"algorithm": algorithm("grpo")})
    trainer.fit()
    assert not seen["deferred"]  # only SPO estimators defer
    assert seen["advantages"][0, 0] > 0  # verl's GRPO: rewards 1, 0
    with pytest.raises(SPOMetadataMissingError):
        compute_advantage(legacy_batch([None] * 2, [1.0, 0.0], [2, 2], 2, ["t", "t"]), adv_estimator="spo_tree",
                          num_repeat=2, config=ALGORITHM)
    with advantages_at_actor_update():  # rows given: the real step, deferral or not
        data = legacy_batch(rows, [1.0, 0.0], [2, 2], 2, ["t", "t"])
        run_spo_step(data, ALGORITHM, rollout_n=2)
    assert data.batch["advantages"].tolist() == [[0.5, 0.5], [-0.5, -0.5]]  # V = 1, 0 under a root of 0.5


def test_missing_column_fails_with_the_fix():
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)},
        non_tensors={"uid": np.array(["u", "u"], dtype=object)},
    )
    with pytest.raises(SPOMetadataMissingError, match="default_agent_loop=spo_tree"):
        run_spo_step(data, ALGORITHM, rollout_n=2)


def test_the_actor_update_applies_the_spo_steps_result(monkeypatch):
    """_update_actor: verl's update trains on the narrowed mask; the step's metrics join the update's (the
    loss's lifted out of actor/), and the step the token budget chose becomes the trainer's last."""
    seen = {}

    def verl_update(self, batch):
        seen["response_mask"] = batch.batch["response_mask"].tolist()
        return DataProto(meta_info={"metrics": {"actor/spo/prob_mask/masked_fraction": 0.5, "actor/pg_loss": 1.0}})

    monkeypatch.setattr(RayPPOTrainer, "_update_actor", verl_update)
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": algorithm(budget={"generated_tokens": 5}),
                                       "actor_rollout_ref": {"rollout": {"n": 2}}})
    trainer.init_spo_state(trainer.config)
    trainer.tokenizer, trainer.global_steps, trainer.total_training_steps = None, 1, 10
    rows = [{"tree_id": "t", "path": [leaf], "segment_ends": [2], "trains": True} for leaf in (1, 2)]
    metrics = trainer._update_actor(legacy_batch(rows, [1.0, 0.0], [2, 2], 3, ["t", "t"])).meta_info["metrics"]
    assert seen["response_mask"] == [[1, 1, 0], [1, 1, 0]]
    assert metrics["spo/prob_mask/masked_fraction"] == 0.5 and metrics["actor/pg_loss"] == 1.0
    assert metrics["spo/generated_tokens"] == metrics["spo/generated_tokens_cumulative"] == 4
    assert metrics["spo/tree/advantage_abs_mean/depth1"] == pytest.approx(0.5)
    assert trainer.total_training_steps == 2  # 4 tokens so far and 4 expected next reach the budget of 5


def test_legacy_task_runner_builds_the_spo_trainer_and_leaves_verl_unchanged(monkeypatch):
    """The runner's run takes verl's steps and builds SPORayPPOTrainer (the datasets, workers and
    training are stood in for here; the real ones run in the end-to-end legacy cases)."""
    built = {}

    class Recorder(SPORayPPOTrainer):
        def __init__(self, **kwargs):
            built.update(kwargs)

        def init_workers(self):
            built["init_workers"] = True

        def fit(self):
            built["fit"] = True

    monkeypatch.setattr("spo_verl.adapters.trainer.runners.SPORayPPOTrainer", Recorder)
    monkeypatch.setattr(main_ppo_v0, "create_rl_dataset", lambda files, *a, is_train, **k: f"{is_train}:{files}")
    monkeypatch.setattr(main_ppo_v0, "create_rl_sampler", lambda data_config, dataset: f"sampler of {dataset}")
    monkeypatch.setattr(main_ppo_v0, "validate_config", lambda **kwargs: built.setdefault("validated", True))
    monkeypatch.setattr("verl.utils.config.omega_conf_to_dataclass",
                        lambda model: type("Model", (), {"tokenizer": "tok", "processor": None})())
    runner = object.__new__(_SPOLegacyTaskRunner)
    runner.role_worker_mapping, runner.mapping = {}, {}
    for step in ("add_critic_worker", "add_reward_model_resource_pool", "add_teacher_model_resource_pool"):
        monkeypatch.setattr(runner, step, lambda config, step=step: built.setdefault(step, True), raising=False)
    monkeypatch.setattr(runner, "add_actor_rollout_worker", lambda config: ("actor", "group"), raising=False)
    monkeypatch.setattr(runner, "add_ref_policy_worker", lambda config, cls: built.setdefault("ref", cls), raising=False)
    monkeypatch.setattr(runner, "init_resource_pool_mgr", lambda config: "pools", raising=False)
    monkeypatch.setattr(main_ppo_v0, "need_reference_policy", lambda config: False)
    monkeypatch.setattr(main_ppo_v0, "need_critic", lambda config: False)
    config = OmegaConf.create({"data": {"train_files": "a.parquet", "val_files": "b.parquet"},
                               "actor_rollout_ref": {"model": {}}})
    runner.run(config)
    assert built["train_dataset"] == "True:a.parquet" and built["val_dataset"] == "False:b.parquet"
    assert built["train_sampler"] == "sampler of True:a.parquet" and built["resource_pool_manager"] == "pools"
    assert built["ray_worker_group_cls"] == "group" and built["ref"] == "actor" and built["tokenizer"] == "tok"
    assert built["init_workers"] and built["fit"] and built["validated"]
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
                      "spo": {"diagnostics": {"sample_log": {"dir": str(directory), "responses_per_step": 2}}}},
        "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": loss_mode}}},
    })
    trainer.tokenizer, trainer.global_steps = CharTokenizer(), 3
    return trainer


def actor_update_advantage_step(trainer, data, num_repeat):
    """What SPORayPPOTrainer._update_actor does before verl's update: fit's own advantage step has run
    (zeros for SPO, deferred), then the SPO step with the rows and the sample log."""
    algorithm = trainer.config.algorithm
    with advantages_at_actor_update():
        compute_advantage(data, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
                          num_repeat=num_repeat, norm_adv_by_std_in_grpo=True, config=algorithm)
    metrics = run_spo_step(data, algorithm, num_repeat, trainer)
    return data, metrics


def test_fit_writes_the_tree_of_a_step_to_the_sample_log(tmp_path):
    from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, read_records

    rows = [
        {"tree_id": "t", "path": [1, 3], "segment_ends": [2, 4], "trains": True},
        {"tree_id": "t", "path": [1, 4], "segment_ends": [2, 5], "trains": True},
        {"tree_id": "t", "path": [1, 4], "segment_ends": [2, 5], "trains": False},  # a stand-in copy
        {"tree_id": "t", "path": [2, 5], "segment_ends": [3, 4], "trains": True},
        {"tree_id": "t", "path": [2, 6], "segment_ends": [3, 5], "trains": True},
    ]
    data = after_old_log_probs(rows, [1.0, 0.0, 0.0, 1.0, 1.0], [4, 5, 5, 4, 5], 5, ["u"] * 5)
    data.batch["response_mask"][2] = 0
    out, _ = actor_update_advantage_step(logging_trainer(tmp_path, "spo_tree"), data, num_repeat=5)
    assert out.batch["response_mask"].sum(dim=1).tolist() == [4, 3, 0, 3, 0]  # narrowed to the trained segments after logging
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["step"] == 3 and len(record["responses"]) == 4  # the stand-in is not a leaf of its own
    assert {n["id"]: n["value"] for n in record["tree"]["nodes"]} == pytest.approx(
        {"root": 0.75, "1": 0.5, "2": 1.0, "3": 1.0, "4": 0.0, "5": 1.0, "6": 1.0})
    assert record["responses"][0]["prompt"] == "fg"  # left padding dropped
    assert record["responses"][1]["trained"] == [0, 0, 1, 1, 1]


def test_fit_logs_baseline_samples_without_spo_metrics(tmp_path):
    from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, read_records

    data = after_old_log_probs([None] * 4, [1.0, 0.0, 1.0, 0.0], [3, 3, 2, 3], 3, ["g", "g", "h", "h"])
    out, metrics = actor_update_advantage_step(logging_trainer(tmp_path, "grpo", loss_mode="vanilla"), data, num_repeat=2)
    assert list(metrics) == ["spo/generated_tokens", "spo/generated_tokens_cumulative"]
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["algorithm"] == "grpo" and record["prob_mask_applied"] is False
    assert [r["uid"] for r in record["responses"]] == ["g", "h"]  # one per prompt first
    assert [len(r["tokens"]) for r in record["responses"]] == [3, 2]
    assert record["responses"][0]["advantages"] == pytest.approx(out.batch["advantages"][0].tolist(), abs=1e-6)


@pytest.mark.parametrize("packed", [True, False])
def test_packed_training_keeps_each_uid_on_one_rank(packed):
    """verl's legacy balancing spreads rows over data-parallel ranks by length; with packed training
    each uid's rows (a prompt's responses) stay together on one rank, so they pack."""
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"spo": {"packing": {"enable": packed}}},
                                       "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}}})
    trainer.init_spo_state(trainer.config)
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


def test_the_trainer_parses_its_spo_settings_once(monkeypatch):
    """When it is built; its steps use what it read (the estimators through the advantage channel)."""
    from spo_verl.adapters import settings

    calls = []
    parse = settings.parse_spo_settings
    monkeypatch.setattr(settings, "parse_spo_settings", lambda raw: calls.append(raw) or parse(raw))
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": ALGORITHM, "actor_rollout_ref": {"rollout": {"n": 4}}})
    trainer.init_spo_state(trainer.config)
    trainer.tokenizer, trainer.global_steps, trainer.total_training_steps = None, 1, 1  # as verl sets them
    rows = [{"tree_id": "t", "path": [leaf], "segment_ends": [2], "trains": True} for leaf in (1, 2)]
    for _ in range(2):
        trainer._spo_step_in_place(legacy_batch(rows, [1.0, 0.0], [2, 2], 3, ["u", "u"]))
    assert len(calls) == 1


class TextTokenizer:
    """One token per character (id = code point): a response's tokens are its characters."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(int(i)) for i in ids)

    def batch_decode(self, sequences, **_):
        return [self.decode(ids) for ids in sequences]


def test_credit_metrics_read_the_legacy_batch_after_its_advantage_step():
    """algorithm.spo.diagnostics.credit_metrics on the legacy trainer: the problem read from the prompt (its last
    question), the first wrong step placed in the answer, GRPO's advantages measured exactly."""

    prompt = "What is 1 + 1? 1 + 1 = 2. #### 2\nWhat is 3 + 4 + 2?"
    right, wrong = "3 + 4 = 7. 7 + 2 = 9. #### 9", "3 + 4 = 8. 8 + 2 = 10. #### 10"
    width = len(wrong)
    data = legacy_batch([None, None], [1.0, 0.0], [len(right), len(wrong)], width, ["u", "u"])
    data.batch["prompts"] = torch.tensor([[ord(c) for c in prompt]] * 2)
    data.batch["attention_mask"] = torch.cat([torch.ones(2, len(prompt), dtype=torch.long),
                                              data.batch["response_mask"].long()], 1)
    data.batch["responses"] = torch.tensor([[ord(c) for c in right.ljust(width)], [ord(c) for c in wrong]])
    data.batch["token_level_scores"] = data.batch["token_level_rewards"].clone()
    data.batch["old_log_probs"] = torch.full((2, width), float(np.log(0.5)))  # every token in the mask
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": "grpo", "spo": {"diagnostics": {"credit_metrics": True}}}})
    trainer.tokenizer, trainer.global_steps = TextTokenizer(), 1
    grpo = algorithm("grpo", diagnostics={"credit_metrics": True})
    compute_advantage(data, adv_estimator="grpo", num_repeat=2, norm_adv_by_std_in_grpo=True, config=grpo)
    metrics = run_spo_step(data, grpo, 2, trainer)
    error = wrong.index("8")  # the wrong result of step 1
    assert metrics["spo/credit/right_answers"] == 1 and metrics["spo/credit/wrong_answers_placed"] == 1
    assert metrics["spo/credit/wrong_answers_not_placed"] == 0 and metrics["spo/credit/wrong_answers_blamed"] == 1
    # GRPO: one advantage a response, so the blame on the error is the share of tokens from the error on.
    assert metrics["spo/credit/blame_on_error"] == pytest.approx((width - error) / width)
    assert metrics["spo/credit/blame_on_error_masked"] == pytest.approx((width - error) / width)
    # Net: the two answers share "3 + 4 = ", where +A and -A cancel; what is left is on the error.
    assert metrics["spo/credit/blame_on_error_net"] == pytest.approx(1.0)
    assert metrics["spo/credit/right_steps_advantage_mean"] == pytest.approx(-(0.5 ** 0.5), abs=1e-5)
    assert metrics["spo/credit/right_steps_negative_fraction"] == 1.0
    assert metrics["spo/credit/right_answers_negative_fraction"] == 0.0
    assert metrics["spo/credit/seconds"] >= 0


DIALOGUE_PROMPT = "user\nStart with 3. Add 4 to that.\nassistant\n3 + 4 = 7\nuser\nStart with 16. Subtract 9 from that.\n"
DIALOGUE_REPLY = "\nuser\nAdd 4 to that.\nassistant\n"  # the environment's, after the model's end of turn "|"


def dialogue_batch(estimator):
    """Two episodes of one dialogue on the legacy trainer's batch, a character a token: both answer turn
    1 right (7), the first turn 2 right (11), the second wrong (12); the environment's reply out of the
    response mask. Under SPO-chain over turns, V(prompt) = 0.5 and V(after turn 1) = 0.75."""
    turn1, right, wrong = "16 - 9 = 7|", "7 + 4 = 11|", "7 + 4 = 12|"
    second = len(turn1) + len(DIALOGUE_REPLY)  # where turn 2 starts
    width = second + len(right)
    rows = [{"segment_starts": [0, second], "boundary_values": [0.5, 0.75]}] * 2 if estimator == "spo_chain" else [None] * 2
    data = legacy_batch(rows, [1.0, 0.0], [width, width], width, ["d", "d"])
    data.batch["response_mask"][:, len(turn1):second] = 0
    data.non_tensor_batch[EPISODE_FIELD] = np.array([{"turns": 2, "reply_tokens": len(DIALOGUE_REPLY),
                                                      "ended_by": "environment"}] * 2, dtype=object)
    data.batch["prompts"] = torch.tensor([[ord(c) for c in DIALOGUE_PROMPT]] * 2)
    data.batch["attention_mask"] = torch.ones(2, len(DIALOGUE_PROMPT) + width, dtype=torch.long)
    data.batch["responses"] = torch.tensor([[ord(c) for c in turn1 + DIALOGUE_REPLY + turn2] for turn2 in (right, wrong)])
    data.batch["token_level_scores"] = data.batch["token_level_rewards"].clone()
    data.batch["old_log_probs"] = torch.full((2, width), float(np.log(0.5)))  # every model token in the mask
    return data


@pytest.mark.parametrize("estimator", ["spo_chain", "grpo"])
def test_credit_metrics_of_dialogues_place_the_first_wrong_turn_and_leave_out_the_environment(estimator):
    """A multi-turn episode's first wrong step is its first wrong turn, and the credit measures read the
    model's tokens only: SPO-chain over turns puts all of the wrong episode's negative advantage on turn 2
    and credits its right turn 1 (+0.25, not diluted by the reply's zeros); GRPO spreads its one
    advantage over both turns (half of the model's tokens are turn 2's)."""

    data = dialogue_batch(estimator)
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": estimator, "spo": {"diagnostics": {"credit_metrics": True}}}})
    trainer.tokenizer, trainer.global_steps = TextTokenizer(), 1
    config = algorithm(estimator, diagnostics={"credit_metrics": True})
    if estimator == "grpo":
        compute_advantage(data, adv_estimator="grpo", num_repeat=2, norm_adv_by_std_in_grpo=True, config=config)
    metrics = run_spo_step(data, config, 2, trainer)
    assert metrics["spo/credit/right_answers"] == 1 and metrics["spo/credit/wrong_answers_placed"] == 1
    assert metrics["spo/turns/first_wrong_turn1"] == 0.0 and metrics["spo/turns/first_wrong_turn2"] == 1.0
    if estimator == "spo_chain":
        assert data.batch["advantages"][1, :11].tolist() == pytest.approx([0.25] * 11)
        assert data.batch["advantages"][1, -11:].tolist() == pytest.approx([-0.75] * 11)
        assert metrics["spo/credit/blame_on_error"] == metrics["spo/credit/blame_on_error_masked"] == 1.0
        assert metrics["spo/credit/blame_on_error_net"] == 1.0
        assert metrics["spo/credit/right_steps_advantage_mean"] == pytest.approx(0.25)
        assert metrics["spo/credit/right_steps_negative_fraction"] == 0.0
    else:
        assert metrics["spo/credit/blame_on_error"] == pytest.approx(0.5)
        assert metrics["spo/credit/blame_on_error_masked"] == pytest.approx(0.5)
        assert metrics["spo/credit/right_steps_advantage_mean"] == pytest.approx(-(0.5 ** 0.5), abs=1e-5)
        assert metrics["spo/credit/right_steps_negative_fraction"] == 1.0
    # The one wrong episode went wrong after a right turn: the per-turn measures are the same numbers.
    for name, renamed in (("blame_on_error", "blame_on_wrong_turn"), ("blame_on_error_masked", "blame_on_wrong_turn_masked"),
                          ("blame_on_error_net", "blame_on_wrong_turn_net"), ("right_steps_advantage_mean", "right_turns_advantage_mean")):
        assert metrics[f"spo/turns/{renamed}"] == metrics[f"spo/credit/{name}"], name


def test_the_per_turn_blame_leaves_out_episodes_wrong_from_their_first_turn():
    """Two wrong episodes under one advantage an episode (-0.5 on every model token): wrong at turn 1, all
    its blame is on the error; wrong at turn 2, half. spo/credit/* averages both, spo/turns/* the second."""
    from spo_verl.adapters.trainer.credit_metrics import step_credit_metrics
    from spo_verl.adapters.trainer.batch_view import SampledResponse

    def episode(index, first, second):
        text = first + DIALOGUE_REPLY + second
        mask = torch.tensor([0.0 if len(first) <= i < len(first) + len(DIALOGUE_REPLY) else 1.0 for i in range(len(text))])
        return SampledResponse(batch_index=index, uid="d", row=None, prompt_ids=[ord(c) for c in DIALOGUE_PROMPT],
                               response_ids=[ord(c) for c in text], log_probs=torch.full((len(text),), float(np.log(0.5))),
                               response_mask=mask, advantages=-0.5 * mask, trained=mask.bool(), score=0.0,
                               episode={"turns": 2, "reply_tokens": len(DIALOGUE_REPLY), "ended_by": "environment"})

    metrics = step_credit_metrics([episode(0, "16 - 9 = 8|", "8 + 4 = 12|"), episode(1, "16 - 9 = 7|", "7 + 4 = 12|")],
                                  TextTokenizer(), 0.9)
    assert metrics["spo/credit/wrong_answers_placed"] == 2 and metrics["spo/credit/blame_on_error"] == pytest.approx(0.75)
    assert metrics["spo/turns/first_wrong_turn1"] == metrics["spo/turns/first_wrong_turn2"] == 0.5
    assert metrics["spo/turns/blame_on_wrong_turn"] == pytest.approx(0.5)
    assert metrics["spo/turns/right_turns_advantage_mean"] == pytest.approx(-0.5)
    only_first = step_credit_metrics([episode(0, "16 - 9 = 8|", "8 + 4 = 12|")], TextTokenizer(), 0.9)
    assert only_first["spo/turns/first_wrong_turn1"] == 1.0 and "spo/turns/blame_on_wrong_turn" not in only_first


@pytest.mark.parametrize("estimator", ["spo_chain", "grpo"])
def test_the_turns_credit_tool_reads_the_dialogues_back_from_the_sample_log(estimator, tmp_path, capsys):
    """The same two episodes through the legacy trainer's sample log, read back by
    ``python -m spo_workbench.credit.turns``: each turn's credit, the first wrong turn, the table."""
    from spo_workbench.credit import turns

    data = dialogue_batch(estimator)
    trainer = object.__new__(SPORayPPOTrainer)
    trainer.config = OmegaConf.create({"algorithm": {"adv_estimator": estimator, "spo": {
        "diagnostics": {"sample_log": {"dir": str(tmp_path), "responses_per_step": 2}}}}})
    trainer.tokenizer, trainer.global_steps = TextTokenizer(), 1
    config = algorithm(estimator)
    if estimator == "grpo":
        compute_advantage(data, adv_estimator="grpo", num_repeat=2, norm_adv_by_std_in_grpo=True, config=config)
    run_spo_step(data, config, 2, trainer)
    rows = turns.read_run(tmp_path)
    if estimator == "spo_chain":  # each turn V(after) - V(before)
        wrong_episode, right_episode = [0.25, -0.75], [0.25, 0.25]
    else:  # one advantage an episode, +-1/sqrt(2)
        wrong_episode, right_episode = [-(0.5 ** 0.5)] * 2, [0.5 ** 0.5] * 2
    got = sorted((r.reward, r.turn, r.tokens, r.first_wrong_turn, r.advantage) for r in rows)
    assert got == [(0.0, 1, 11, 2, pytest.approx(wrong_episode[0], abs=1e-6)),  # the sample log keeps 6 places
                   (0.0, 2, 11, 2, pytest.approx(wrong_episode[1], abs=1e-6)),
                   (1.0, 1, 11, None, pytest.approx(right_episode[0], abs=1e-6)),
                   (1.0, 2, 11, None, pytest.approx(right_episode[1], abs=1e-6))]
    blame = turns.episode_blame([r for r in rows if r.reward == 0])
    assert blame.on_wrong_turn == pytest.approx(1.0 if estimator == "spo_chain" else 0.5)
    assert blame.right_turns_advantage == pytest.approx(wrong_episode[0], abs=1e-6)
    assert turns.main([str(tmp_path), "--csv", str(tmp_path / "turns.csv")]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| `{estimator}`"))
    assert line.split(" | ")[1:7] == ["1", "2", "1", "0", "1", "0"]  # runs, episodes, right, turn 1, later, not placed
    assert len((tmp_path / "turns.csv").read_text().splitlines()) == 1 + 4


def test_the_turns_credit_tool_shows_a_shared_turns_advantage_on_every_leaf_through_it():
    """A tree trains a first turn its leaves share on one leaf's row (0 in the others' advantages); what
    the estimator said of this leaf's turn 1 is still its node's advantage."""
    from spo_workbench.credit.turns import turn_credits

    turn1, turn2 = "16 - 9 = 7|", "7 + 4 = 12|"
    tokens = list(turn1 + DIALOGUE_REPLY + turn2)
    second = len(turn1) + len(DIALOGUE_REPLY)
    leaf = {"prompt": DIALOGUE_PROMPT, "tokens": tokens, "score": 0.0, "in_prob_mask": [1] * len(tokens),
            "environment": [0] * len(turn1) + [1] * len(DIALOGUE_REPLY) + [0] * len(turn2),
            "advantages": [0.0] * second + [-0.5] * len(turn2),  # as the loss gets them: turn 1 trained elsewhere
            "segments": [{"start": 0, "end": second, "advantage": 0.25, "trained": False},
                         {"start": second, "end": len(tokens), "advantage": -0.5, "trained": True}]}
    rows = turn_credits(leaf, "run", "spo_tree", 0, 1, 0)
    assert [(r.turn, r.tokens, r.advantage, r.negative_mass, r.first_wrong_turn) for r in rows] == [
        (1, 11, 0.25, 0.0, 2), (2, 11, -0.5, -5.5, 2)]


def test_credit_metrics_leave_out_a_trees_stand_in_rows():
    """A stand-in row (a copy of a real leaf in an unused slot, ``trains`` false) is not a second answer."""
    from spo_verl.adapters.trainer.credit_metrics import step_credit_metrics
    from spo_verl.adapters.trainer.batch_view import SampledResponse

    prompt, wrong = "What is 3 + 4 + 2?", "3 + 4 = 8. 8 + 2 = 10. #### 10"
    ids = [ord(c) for c in wrong]

    def leaf(index, trains):
        row = {"tree_id": "t", "path": [1], "segment_ends": [len(ids)], "trains": trains}
        return SampledResponse(batch_index=index, uid="t", row=row, prompt_ids=[ord(c) for c in prompt], response_ids=ids,
                               log_probs=torch.full((len(ids),), float(np.log(0.5))), response_mask=torch.ones(len(ids)),
                               advantages=torch.full((len(ids),), -0.5), trained=torch.ones(len(ids), dtype=torch.bool),
                               score=0.0)

    metrics = step_credit_metrics([leaf(0, True), leaf(1, False)], TextTokenizer(), 0.9)
    assert metrics["spo/credit/wrong_answers_placed"] == 1 and metrics["spo/credit/right_answers"] == 0
