"""SPOTrainer._compute_advantage on verl's real TransferQueue data path (trainer.use_v1=true).

Trajectories are stored exactly as verl's AgentLoopWorkerTQ stores them (AgentLoopOutput.as_dict
plus the row kwargs, one TransferQueue key per output); the trainer override then runs verl's own
advantage step with the SPO metadata visible to the estimator.
"""

import numpy as np
import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from spo_verl.adapters.estimators import SPOMetadataMissingError
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.v1 import SPOTrainer

PAPER_LEAF_REWARDS = [1, 0, 1, 1, 1, 1, 0, 0, 0]


@pytest.fixture(scope="module")
def transfer_queue():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield
    tq.close()
    ray.shutdown()


def store(outputs, uid_of, partition_id="train"):
    """What AgentLoopWorkerTQ._agent_loop_postprocess writes for each output."""
    keys, fields, tags = [], [], []
    for session, output in enumerate(outputs):
        uid = uid_of(session)
        field = output.as_dict()
        field.update({"uid": uid, "session_id": session, "global_steps": 1})
        field["loss_mask"] = field["response_mask"]
        field["input_ids"] = torch.cat([field["prompts"], field["responses"]])
        field["position_ids"] = torch.arange(field["input_ids"].numel())
        keys.append(f"{uid}_{session}_0")
        fields.append(field)
        tags.append({"status": "success"})
    tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=list_of_dict_to_tensordict(fields), tags=tags)
    return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags)


def leaf(path, segment_ends, reward, spo_extra=None, length=5):
    spo = {"tree_id": "tree1", "path": path, "segment_ends": segment_ends, "trains": True,
           "tree": {"nodes": 12, "leaves": 9, "early_stops_per_depth": [0, 0], "generated_tokens": 33,
                    "independent_sample_tokens": 45}}
    spo.update(spo_extra or {})
    return AgentLoopOutput(
        prompt_ids=[3, 4],
        response_ids=list(range(10, 10 + length)),
        response_mask=[1] * length,
        response_logprobs=[-0.5] * length,
        reward_score=float(reward),
        num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields={"spo": spo, "turn_scores": [], "tool_rewards": []},
    )


def trainer(adv_estimator="spo_tree", **spo):
    config = OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": adv_estimator, "use_kl_in_reward": False, "gamma": 1.0, "lam": 1.0,
                "norm_adv_by_std_in_grpo": True, "rollout_correction": None, "spo": spo,
            },
            "actor_rollout_ref": {"rollout": {"n": 9}},
        }
    )
    instance = SPOTrainer.__new__(SPOTrainer)  # no workers: only the advantage step is exercised
    instance.config = config
    instance.init_spo_state(config)  # what the constructor does before verl's
    instance.tokenizer, instance.global_steps, instance.total_training_steps = None, 1, 1  # as verl sets them
    return instance


def test_paper_tree_through_transfer_queue(transfer_queue):
    outputs = [leaf([1 + i // 3, 4 + i], [2, 5], r) for i, r in enumerate(PAPER_LEAF_REWARDS)]
    padding = leaf([1, 4], [2, 5], 0.0)  # verl's padding row: a copy of another row's metadata
    padding.response_mask = [0] * 5
    batch = store(outputs + [padding], lambda s: "tree1" if s < 9 else "pad9f3e")
    metrics = {}
    trainer()._compute_advantage(batch, metrics)
    stored = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                             select_fields=["advantages", "response_mask", "loss_mask"])
    advantages = stored["advantages"].to_padded_tensor(0.0)
    assert advantages[0].tolist() == pytest.approx([1 / 9, 1 / 9, 1 / 3, 1 / 3, 1 / 3])
    assert advantages[1].tolist() == pytest.approx([0, 0, -2 / 3, -2 / 3, -2 / 3])
    assert advantages[3].tolist() == pytest.approx([4 / 9, 4 / 9, 0, 0, 0])
    assert advantages[6].tolist() == pytest.approx([-5 / 9, -5 / 9, 0, 0, 0])
    assert advantages[[4, 5, 7, 8, 9]].abs().sum() == 0
    # The loss is restricted to the trained segments: each segment once, zero-advantage ones dropped.
    trained = stored["response_mask"].to_padded_tensor(0)
    assert trained.sum(dim=1).tolist() == [5, 3, 3, 2, 0, 0, 2, 0, 0, 0]
    assert torch.equal(trained, stored["loss_mask"].to_padded_tensor(0))
    assert metrics["spo/tree/trees"] == 1 and metrics["spo/tree/leaves_per_tree"] == 9
    assert metrics["spo/tree/advantage_mean/depth1"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["spo/tree/advantage_abs_mean/depth1"] == pytest.approx((1 / 9 + 4 / 9 + 5 / 9) / 3)
    assert metrics["spo/tree/zero_advantage_fraction/depth2"] == pytest.approx(6 / 9)
    assert metrics["spo/tree/generated_over_independent"] == pytest.approx(33 / 45)
    assert metrics["spo/tree/segment_tokens_mean"] == pytest.approx(33 / 12)  # 33 tokens over 12 nodes
    assert metrics["spo/trained_token_fraction"] == pytest.approx(15 / 45) and metrics["spo/trained_tokens"] == 15
    # Each node generated once (33 tokens), not the 45 of the leaf rows; the padding row adds nothing.
    assert metrics["spo/generated_tokens"] == metrics["spo/tree/generated_tokens"] == 33


def test_missing_metadata_fails_with_the_fix(transfer_queue):
    plain = AgentLoopOutput(prompt_ids=[3], response_ids=[5, 6], response_mask=[1, 1], reward_score=1.0,
                            metrics=AgentLoopMetrics(), extra_fields={"turn_scores": [], "tool_rewards": []})
    batch = store([plain, plain], lambda s: "plain1")
    with pytest.raises(SPOMetadataMissingError, match="default_agent_loop=spo_tree"):
        trainer()._compute_advantage(batch, {})


def test_non_spo_estimators_take_verls_path_unchanged(transfer_queue):
    outputs = [leaf([1], [5], r) for r in (1.0, 0.0, 1.0, 0.0)]
    batch = store(outputs, lambda s: "grpo1")
    metrics = {}
    trainer("grpo")._compute_advantage(batch, metrics)
    stored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "response_mask"])
    advantages = stored["advantages"].to_padded_tensor(0.0)[:, 0]
    expected = (torch.tensor([1.0, 0, 1, 0]) - 0.5) / (torch.tensor([1.0, 0, 1, 0]).std() + 1e-6)
    assert advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert stored["response_mask"].to_padded_tensor(0).sum() == 20
    # verl's metrics are verl's; only the step's generated tokens are counted (4 responses x 5 tokens).
    assert {k: v for k, v in metrics.items() if k.startswith("spo/")} == {
        "spo/generated_tokens": 20.0, "spo/generated_tokens_cumulative": 20.0}


def test_the_token_budget_makes_the_step_expected_to_reach_it_the_last(transfer_queue):
    outputs = [leaf([1], [5], r) for r in (1.0, 0.0, 1.0, 0.0)]
    spo_trainer = trainer("grpo", budget={"generated_tokens": 30})
    spo_trainer.global_steps, spo_trainer.total_training_steps = 1, 10
    metrics = {}
    spo_trainer._compute_advantage(store(outputs, lambda s: "budget1"), metrics)
    assert metrics["spo/generated_tokens_cumulative"] == 20.0
    assert spo_trainer.total_training_steps == 2  # 20 tokens so far and 20 expected next reach 30


def test_loss_metrics_are_lifted_out_of_the_actor_prefix():
    metrics = {"actor/spo/prob_mask/masked_fraction": 0.3, "actor/pg_loss": 1.0}
    lift_spo_metrics(metrics)
    assert metrics == {"spo/prob_mask/masked_fraction": 0.3, "actor/pg_loss": 1.0}


def test_actor_update_gets_only_rows_that_train_something(transfer_queue, monkeypatch):
    """Leaves whose segments are all trained elsewhere or all zero cost no actor forward/backward."""
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    # Leaves of 5 tokens but the first of 7: verl's padding rows are built from the first row.
    outputs = [leaf([1 + i // 3, 4 + i], [2, 7 if i == 0 else 5], r, {"tree_id": "tree2"}, length=7 if i == 0 else 5)
               for i, r in enumerate(PAPER_LEAF_REWARDS)]
    stored = store(outputs, lambda s: "tree2")
    spo_trainer = trainer()
    batch = spo_trainer._compute_advantage(stored, {})  # what verl's step hands on to the actor update
    assert batch.keys == stored.keys
    # verl's bypass mode: the rollout's log-probs become the old log-probs before the update.
    rollout = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["rollout_log_probs"])
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                    fields=TensorDict({"old_log_probs": rollout["rollout_log_probs"]}, batch_size=len(batch)))
    updated = {}

    def verl_update(self, update, metrics):
        updated["keys"] = list(update.keys)
        return update

    monkeypatch.setattr(PPOTrainerSync, "_update_actor", verl_update)
    # verl's balancing pads to a multiple (here 4) with synthetic rows stored in TransferQueue.
    monkeypatch.setattr(spo_trainer, "_balance_batch",
                        lambda update, metrics, logging_prefix: upsample_batch_to_divisible_size(update, 4, 0),
                        raising=False)
    metrics = {}
    returned = spo_trainer._update_actor(batch, metrics)
    trained_rows = [batch.keys[i] for i in (0, 1, 2, 3, 6)]  # per-row trained token counts 5,3,3,2,0,0,2,0,0
    assert updated["keys"][:5] == trained_rows and len(updated["keys"]) == 8
    assert all(key.startswith("pad") for key in updated["keys"][5:])
    assert metrics["spo/actor_update_rows"] == 5 and metrics["spo/actor_skipped_rows"] == 4
    # Every row verl's loss reads has one length across its per-token fields: a padding row's are one
    # token (a 7-token copy would widen old_log_probs past response_mask in a micro-batch of short rows).
    fields = ["response_mask", "old_log_probs", "advantages"]
    update_rows = tq.kv_batch_get(keys=updated["keys"], partition_id=batch.partition_id, select_fields=fields)
    lengths = {name: update_rows[name].offsets().diff().tolist() for name in fields}
    assert lengths["response_mask"] == lengths["old_log_probs"] == lengths["advantages"] == [7, 5, 5, 5, 5, 1, 1, 1]
    short = tq.kv_batch_get(keys=updated["keys"][1:], partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
    assert {short[name].shape[1] for name in fields} == {5}
    assert float(short["old_log_probs"][-1].abs().sum()) == 0 and float(short["advantages"][-1].abs().sum()) == 0
    # Everything, padding included, goes back to verl for metrics and TransferQueue cleanup.
    assert returned.keys == batch.keys + updated["keys"][5:]


def test_a_step_with_nothing_to_train_skips_the_actor(transfer_queue, monkeypatch):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    outputs = [leaf([1 + i // 3, 4 + i], [2, 5], 1.0, {"tree_id": "tree3"}) for i in range(9)]  # all equal
    spo_trainer = trainer()
    batch = spo_trainer._compute_advantage(store(outputs, lambda s: "tree3"), {})
    monkeypatch.setattr(PPOTrainerSync, "_update_actor", lambda *a: pytest.fail("actor update without tokens"))
    metrics = {}
    assert spo_trainer._update_actor(batch, metrics) is batch
    assert metrics["spo/actor_update_rows"] == 0 and metrics["spo/actor_skipped_rows"] == 9


CHAIN_PROBS = [0.99, 0.72, 1.0, 0.85, 1.0, 0.56, 0.92, 0.23, 0.98, 0.11, 1.0]


def chain_outputs():
    """The paper's chain (cutpoints int2, V, R = 1) and a chain without a cutpoint (R = 0)."""
    probs = CHAIN_PROBS
    chain = {"segment_starts": [1, 5, 9], "boundary_values": [0.5, 0.25, 0.75],
             "chain": {"boundaries": 3, "mc_continuations": 27, "mc_tokens": 100, "mc_truncated": 9, "cutpoint_requests": 0,
                       "no_cutpoint": False, "capped": False}}
    flat = {"segment_starts": [], "boundary_values": [],
            "chain": {"boundaries": 0, "mc_continuations": 0, "mc_tokens": 0, "mc_truncated": 0, "cutpoint_requests": 0,
                      "no_cutpoint": True, "capped": False}}
    outputs = []
    for spo, reward in ((chain, 1.0), (flat, 0.0)):
        outputs.append(AgentLoopOutput(
            prompt_ids=[3, 4], response_ids=list(range(11)), response_mask=[1] * 11,
            response_logprobs=[float(np.log(p)) for p in probs], reward_score=reward, num_turns=2,
            metrics=AgentLoopMetrics(), extra_fields={"spo": spo, "turn_scores": [], "tool_rewards": []},
        ))
    return outputs


def test_chain_worked_example_through_transfer_queue(transfer_queue):
    """the paper's chain example on the default trainer's data path: p, cutpoints int2, V, R = 1."""
    batch = store(chain_outputs(), lambda s: "chain1")
    metrics = {}
    trainer("spo_chain")._compute_advantage(batch, metrics)
    stored = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "response_mask"])
    advantages = stored["advantages"].to_padded_tensor(0.0)
    assert advantages[0].tolist() == pytest.approx([0, -0.25, -0.25, -0.25, -0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25])
    assert advantages[1].abs().sum() == 0
    # The chain estimator trains every token (the probability mask is applied by the loss).
    assert stored["response_mask"].to_padded_tensor(0).sum() == 22
    assert metrics["spo/chain/boundaries_per_response"] == 1.5
    assert metrics["spo/chain/mc_continuations"] == 27 and metrics["spo/chain/no_cutpoint_fraction"] == 0.5
    assert metrics["spo/generated_tokens"] == 22 + 100  # both responses and the continuations
    assert metrics["spo/chain/boundary_value_mean"] == pytest.approx(0.5)
    assert metrics["spo/chain/mc_truncated_fraction"] == 9 / 27


def test_verls_padding_rows_add_nothing_to_the_chains_monte_carlo_cost(transfer_queue):
    """verl balances (and so pads) the batch before the advantage step, with copies of the first row's
    extra fields: the chain's Monte Carlo tokens, which the token budget counts, stay those of the
    real rows."""
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

    batch = upsample_batch_to_divisible_size(store(chain_outputs(), lambda s: "chain2"), 4, eos_token_id=2)
    assert [tag.get("is_padding", False) for tag in batch.tags] == [False, False, True, True]
    metrics = {}
    trainer("spo_chain")._compute_advantage(batch, metrics)
    assert metrics["spo/chain/mc_tokens"] == 100 and metrics["spo/chain/mc_continuations"] == 27
    assert metrics["spo/chain/boundaries_per_response"] == 1.5
    assert metrics["spo/generated_tokens"] == 22 + 100


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def logging_trainer(directory, adv_estimator="spo_tree", step=5):
    instance = trainer(adv_estimator, diagnostics={"sample_log": {"dir": str(directory), "responses_per_step": 2}})
    instance.tokenizer, instance.global_steps = CharTokenizer(), step
    return instance


def put_old_log_probs(batch, probs):
    """What verl's old-log-prob step writes before the advantage step."""
    from verl.workers.utils.padding import response_to_nested

    mask = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])["response_mask"]
    padded = torch.tensor(probs, dtype=torch.float32).log()
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                    fields=TensorDict({"old_log_probs": response_to_nested(padded, mask)}, batch_size=len(batch.keys)))


def test_the_sample_log_gets_the_whole_tree_from_transfer_queue(transfer_queue, tmp_path):
    from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, read_records

    outputs = [leaf([1 + i // 3, 4 + i], [2, 5], r, {"tree_id": "tree4"}) for i, r in enumerate(PAPER_LEAF_REWARDS)]
    padding = leaf([1, 4], [2, 5], 0.0, {"tree_id": "tree4"})
    padding.response_mask = [0] * 5
    batch = store(outputs + [padding], lambda s: "tree4" if s < 9 else "pad77")
    put_old_log_probs(batch, [[0.5, 0.95, 0.2, 0.99, 0.3]] * 10)
    metrics = {}
    logging_trainer(tmp_path)._compute_advantage(batch, metrics)
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["step"] == 5 and record["algorithm"] == "spo_tree"
    assert len(record["responses"]) == 9  # every leaf of the tree, not responses_per_step; no padding row
    nodes = {n["id"]: n for n in record["tree"]["nodes"]}
    # the paper's tree: V(a) = 2/3, V(b) = 1, V(c) = 0, V(root) = 5/9.
    assert nodes["root"]["value"] == pytest.approx(5 / 9, abs=1e-6)
    assert [nodes[n]["value"] for n in "123"] == pytest.approx([2 / 3, 1, 0], abs=1e-6)
    assert [nodes[n]["advantage"] for n in "123"] == pytest.approx([1 / 9, 4 / 9, -5 / 9], abs=1e-6)
    assert [nodes[str(4 + i)]["reward"] for i in range(9)] == PAPER_LEAF_REWARDS
    first = record["responses"][0]
    assert first["in_prob_mask"] == [1, 0, 1, 0, 1] and first["tokens"] == ["k", "l", "m", "n", "o"]
    assert first["advantages"] == pytest.approx([1 / 9, 1 / 9, 1 / 3, 1 / 3, 1 / 3], abs=1e-6)
    assert [r["trained"] for r in record["responses"][:2]] == [[1] * 5, [0, 0, 1, 1, 1]]
    assert first["prompt"] == "de"


def test_the_sample_log_of_a_baseline_adds_no_spo_metric(transfer_queue, tmp_path):
    from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, read_records

    outputs = [leaf([1], [5], r) for r in (1.0, 0.0, 1.0, 0.0)]
    batch = store(outputs, lambda s: "grpo5")
    put_old_log_probs(batch, [[0.5] * 5] * 4)
    metrics = {}
    logging_trainer(tmp_path, "grpo", step=2)._compute_advantage(batch, metrics)
    assert {k for k in metrics if k.startswith("spo/")} == {"spo/generated_tokens", "spo/generated_tokens_cumulative"}
    (record,) = read_records(tmp_path / SAMPLES_FILE)
    assert record["algorithm"] == "grpo" and len(record["responses"]) == 2
    assert [r["score"] for r in record["responses"]] == [1.0, 0.0]
    assert [len(r["segments"]) for r in record["responses"]] == [1, 1]
    assert record["responses"][0]["segments"][0]["advantage"] > 0 > record["responses"][1]["segments"][0]["advantage"]


def test_the_replay_buffer_looks_for_finished_rollouts_often():
    """verl's sync replay buffer (built by verl's own code here) polls every 2 s, which rounds each
    step's generation up to the next 2 s; the SPO trainer's polls every ROLLOUT_POLL_S."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from spo_workbench.testing.verl_harness import compose_ppo_trainer
    from spo_verl.adapters.trainer.v1 import ROLLOUT_POLL_S, SPOTrainer

    trainer = object.__new__(SPOTrainer)
    trainer.config = compose_ppo_trainer("trainer.v1.trainer_mode=sync")
    trainer.trainer_mode = "sync"
    buffer = trainer._build_replay_buffer()
    assert type(buffer) is ReplayBuffer and ReplayBuffer(
        trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
        sampler_kwargs={}).poll_interval == 2.0
    assert buffer.poll_interval == ROLLOUT_POLL_S < 1.0


def test_the_sample_log_and_the_credit_metrics_fetch_each_row_once(transfer_queue, tmp_path, monkeypatch):
    from spo_verl.adapters.trainer import transfer_queue_batch
    from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, read_records

    outputs = [leaf([1], [5], r) for r in (1.0, 0.0, 1.0, 0.0)]
    batch = store(outputs, lambda s: "grpo6")
    put_old_log_probs(batch, [[0.5] * 5] * 4)
    fetched_rows = []
    original = transfer_queue_batch.tq.kv_batch_get

    def counting_get(keys, partition_id, select_fields=None, **kwargs):
        if select_fields and "responses" in select_fields:
            fetched_rows.extend(batch.keys.index(key) for key in keys)
        return original(keys=keys, partition_id=partition_id, select_fields=select_fields, **kwargs)

    monkeypatch.setattr(transfer_queue_batch.tq, "kv_batch_get", counting_get)
    instance = trainer("grpo", diagnostics={"sample_log": {"dir": str(tmp_path), "responses_per_step": 2}, "credit_metrics": True})
    instance.tokenizer, instance.global_steps = CharTokenizer(), 3
    metrics = {}
    instance._compute_advantage(batch, metrics)
    assert sorted(fetched_rows) == [0, 1, 2, 3]  # the sample log's two rows, then the other two for the metrics
    assert len(read_records(tmp_path / SAMPLES_FILE)[0]["responses"]) == 2
    assert any(key.startswith("spo/credit/") for key in metrics)
