"""The spo_prob_mask loss: the paper's masked-loss numbers, directly and through verl's actor loss path."""

import math

import pytest
import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

import spo_verl.register  # noqa: F401
from spo_verl.core.algorithms import probability_mask, reference_policy_loss, whiten_over_mask
from spo_verl.core.config import SPOConfigError
from spo_verl.adapters.policy_loss import SPOPolicyLossConfig, spo_ppo_loss
from spo_workbench.testing.verl_harness import loss_batch

ADVANTAGES = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.0]])
RESPONSE_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD_PROBS = torch.tensor([[0.5, 0.95, 0.2], [0.6, 0.3, 1.0]])
OLD_LOG_PROB = OLD_PROBS.log()
LOG_PROB = OLD_LOG_PROB + torch.tensor([[0.3, -0.1, 0.05], [-0.4, 0.25, 0.0]])
REF_LOG_PROB = OLD_LOG_PROB + torch.tensor([[0.1, 0.0, -0.2], [0.0, 0.1, 0.0]])
EXPECTED_PG_LOSS = 0.1149237
EXPECTED_KL_TERM = 7.5032e-6  # times kl_loss_coef 1e-4


def actor_config(normalization="reference", use_kl_loss=False, policy_loss_cls=SPOPolicyLossConfig, **loss_kwargs):
    if policy_loss_cls is SPOPolicyLossConfig:
        loss_kwargs.setdefault("spo", {"prob_mask": {"normalization": normalization}})
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio=0.2,
        loss_agg_mode="token-mean",
        use_kl_loss=use_kl_loss,
        kl_loss_coef=1e-4,
        policy_loss=policy_loss_cls(loss_mode="spo_prob_mask", **loss_kwargs),
    )


def test_whitened_advantages_worked_example():
    mask = probability_mask(OLD_LOG_PROB, RESPONSE_MASK)
    assert int(mask.sum()) == 4
    whitened = whiten_over_mask(ADVANTAGES, mask)
    expected = [[-0.866025] * 3, [0.866025, 0.866025, -1.73205]]
    assert whitened.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


def test_whitening_with_fewer_than_two_masked_tokens():
    one = torch.tensor([[False, True, False], [False, False, False]])
    assert whiten_over_mask(ADVANTAGES, one)[one].tolist() == [0.0]  # its own mean, variance 0
    assert torch.isfinite(whiten_over_mask(ADVANTAGES, one)).all()
    assert whiten_over_mask(ADVANTAGES, torch.zeros_like(one)).tolist() == [[0.0] * 3] * 2


def test_the_reference_loss_reads_nothing_back_from_the_device():
    """The core's loss runs on the meta device, where reading any value back (``bool()``, ``.item()``, a
    branch on a count) raises: so on a GPU it never waits for the device, and the adapter reads its
    metrics back in one copy."""
    meta = torch.device("meta")
    log_prob = torch.empty(4, 8, device=meta, requires_grad=True)
    old_log_prob, advantages = torch.empty(4, 8, device=meta), torch.empty(4, 8, device=meta)
    mask = probability_mask(old_log_prob, torch.ones(4, 8, dtype=torch.bool, device=meta))
    terms = reference_policy_loss(log_prob, old_log_prob, advantages, mask, token_weights=torch.empty(4, 8, device=meta))
    terms.loss.backward()
    assert log_prob.grad.shape == (4, 8)
    assert {t.shape for t in terms} == {torch.Size([])}
    with pytest.raises(RuntimeError, match="meta"):
        bool(terms.skipped)  # the check above could not pass if the loss had read a value


def test_direct_call_matches_worked_example():
    loss_fn = get_policy_loss_fn("spo_prob_mask")
    loss, metrics = loss_fn(
        old_log_prob=OLD_LOG_PROB,
        log_prob=LOG_PROB.clone().requires_grad_(True),
        advantages=ADVANTAGES,
        response_mask=RESPONSE_MASK.bool(),
        loss_agg_mode="token-mean",
        config=actor_config(),
        rollout_is_weights=None,
    )
    assert loss.item() == pytest.approx(EXPECTED_PG_LOSS, abs=1e-6)
    assert metrics["spo/prob_mask/masked_fraction"] == pytest.approx(4 / 5)
    assert all(isinstance(v, float) for v in metrics.values())


def test_without_a_threshold_the_reference_loss_covers_every_response_token():
    """``prob_mask.threshold: null``: the SPO reference's GRPO baseline, its loss otherwise SPO's. The 5
    response tokens' advantages [0.1, 0.1, 0.1, 0.3, 0.3] whiten (mean 0.18, unbiased variance 0.012) to
    -0.730296 and 1.095445; PPO-clip at ratios exp([0.3, -0.1, 0.05, -0.4, 0.25]) averages to 0.0731008."""
    config = actor_config(spo={"prob_mask": {"threshold": None}})
    log_prob = LOG_PROB.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("spo_prob_mask")(OLD_LOG_PROB, log_prob, ADVANTAGES, RESPONSE_MASK.bool(),
                                                         "token-mean", config, None)
    assert loss.item() == pytest.approx(0.0731008, abs=1e-6)
    assert metrics["spo/prob_mask/masked_fraction"] == 1.0
    # Small steps (nothing clipped): every response token gets a gradient, the padding none.
    small = (OLD_LOG_PROB + 0.01).requires_grad_(True)
    get_policy_loss_fn("spo_prob_mask")(OLD_LOG_PROB, small, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", config,
                                        None)[0].backward()
    assert (small.grad[RESPONSE_MASK.bool()] != 0).all() and (small.grad[~RESPONSE_MASK.bool()] == 0).all()
    with pytest.raises(SPOConfigError, match=r"prob_mask.threshold.*a number in \(0, 1\], or null"):
        actor_config(spo={"prob_mask": {"threshold": 1.5}})


def test_only_masked_tokens_get_gradient():
    # Small steps, so no token is clipped and every masked-in token must get a gradient.
    log_prob = (OLD_LOG_PROB + 0.01).requires_grad_(True)
    loss, _ = get_policy_loss_fn("spo_prob_mask")(
        OLD_LOG_PROB, log_prob, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", actor_config(), None
    )
    loss.backward()
    mask = probability_mask(OLD_LOG_PROB, RESPONSE_MASK)
    assert (log_prob.grad[~mask] == 0).all()
    assert (log_prob.grad[mask] != 0).all()


def test_no_masked_token_gives_zero_loss_not_nan():
    confident = torch.full((2, 3), math.log(0.99))
    for normalization in ("reference", "verl"):
        log_prob = confident.clone().requires_grad_(True)
        loss, _ = get_policy_loss_fn("spo_prob_mask")(
            confident, log_prob, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", actor_config(normalization), None
        )
        loss.backward()
        assert loss.item() == 0.0
        assert torch.isfinite(log_prob.grad).all()


GLOBAL_INFO = {"dp_size": 1, "batch_num_tokens": int(RESPONSE_MASK.sum()), "global_batch_size": 2}


def test_verl_normalization_is_vanilla_on_masked_tokens_over_all_response_tokens():
    config = actor_config("verl")
    config.global_batch_info.update(GLOBAL_INFO)
    loss, metrics = get_policy_loss_fn("spo_prob_mask")(
        OLD_LOG_PROB, LOG_PROB, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", config, None
    )
    mask = probability_mask(OLD_LOG_PROB, RESPONSE_MASK)
    vanilla_config = actor_config(policy_loss_cls=PolicyLossConfig)
    vanilla_config.global_batch_info.update(GLOBAL_INFO)
    expected, _ = compute_policy_loss_vanilla(OLD_LOG_PROB, LOG_PROB, ADVANTAGES, mask, "token-mean", vanilla_config)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-7)
    assert "actor/pg_clipfrac" in metrics


def test_reference_normalization_is_not_zeroed_advantages_over_response_tokens():
    """the paper: verl's token-mean divides by all response tokens, the reference by masked-in ones."""
    mask = probability_mask(OLD_LOG_PROB, RESPONSE_MASK)
    global_info = GLOBAL_INFO
    config = actor_config("reference")
    config.global_batch_info.update(global_info)
    reference, _ = get_policy_loss_fn("spo_prob_mask")(
        OLD_LOG_PROB, LOG_PROB, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", config, None
    )
    zeroed_config = actor_config(policy_loss_cls=PolicyLossConfig)
    zeroed_config.global_batch_info.update(global_info)
    whitened = whiten_over_mask(ADVANTAGES, mask) * mask
    zeroed, _ = compute_policy_loss_vanilla(
        OLD_LOG_PROB, LOG_PROB, whitened, RESPONSE_MASK.bool(), "token-mean", zeroed_config
    )
    assert reference.item() == pytest.approx(EXPECTED_PG_LOSS, abs=1e-6)
    # Zeroing scales the step by the masked fraction (4 of 5 tokens) and drops the reference's ratio mask.
    assert zeroed.item() != pytest.approx(reference.item(), abs=1e-4)


def test_micro_batches_are_combined_by_their_token_share():
    """Two micro-batches of one mini-batch: verl sums their losses, each weighted by its token share."""
    config = actor_config("reference")
    config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2})
    loss_fn = get_policy_loss_fn("spo_prob_mask")
    parts = [
        loss_fn(OLD_LOG_PROB[i : i + 1], LOG_PROB[i : i + 1], ADVANTAGES[i : i + 1], RESPONSE_MASK[i : i + 1].bool(),
                "token-mean", config, None)[0]
        for i in range(2)
    ]
    singles = []
    for i in range(2):
        alone = actor_config("reference")
        singles.append(loss_fn(OLD_LOG_PROB[i : i + 1], LOG_PROB[i : i + 1], ADVANTAGES[i : i + 1],
                               RESPONSE_MASK[i : i + 1].bool(), "token-mean", alone, None)[0])
    assert parts[0].item() == pytest.approx(singles[0].item() * 3 / 5, abs=1e-7)
    assert parts[1].item() == pytest.approx(singles[1].item() * 2 / 5, abs=1e-7)


def actor_batch(prompt_length=2):
    """A padded batch as the legacy trainer builds it, converted by verl's own left_right_2_no_padding,
    plus the model output the actor produces for it (a nested log-prob per input token)."""
    data, model_output = loss_batch(LOG_PROB, prompt_length, response_mask=RESPONSE_MASK,
                                    old_log_probs=OLD_LOG_PROB, ref_log_prob=REF_LOG_PROB, advantages=ADVANTAGES)
    model_output["log_probs"].requires_grad_(True)
    return data, model_output


def test_through_verls_ppo_loss():
    data, model_output = actor_batch()
    loss, metrics = ppo_loss(actor_config("reference"), model_output, data)
    assert loss.item() == pytest.approx(EXPECTED_PG_LOSS, abs=1e-6)
    loss.backward()
    assert model_output["log_probs"].grad is not None


def test_through_verls_ppo_loss_verl_normalization_uses_global_token_count():
    data, model_output = actor_batch()
    loss, _ = ppo_loss(actor_config("verl"), model_output, data)
    mask = probability_mask(OLD_LOG_PROB, RESPONSE_MASK)
    config = actor_config(policy_loss_cls=PolicyLossConfig)
    config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2})
    expected, _ = compute_policy_loss_vanilla(OLD_LOG_PROB, LOG_PROB, ADVANTAGES, mask, "token-mean", config)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-7)


def test_masked_kl_through_spo_ppo_loss():
    data, model_output = actor_batch()
    loss, metrics = spo_ppo_loss(actor_config("reference", use_kl_loss=True), model_output, data)
    assert loss.item() == pytest.approx(EXPECTED_PG_LOSS + EXPECTED_KL_TERM, abs=1e-6)
    assert loss.item() - _pg_only("reference") == pytest.approx(EXPECTED_KL_TERM, abs=1e-9)
    assert metrics["kl_loss"] * 1e-4 == pytest.approx(EXPECTED_KL_TERM, rel=1e-4)


def test_spo_ppo_loss_keeps_verls_kl_outside_reference_mode():
    data, model_output = actor_batch()
    config = actor_config("verl", use_kl_loss=True)
    ours, _ = spo_ppo_loss(config, model_output, data)
    data, model_output = actor_batch()
    verls, _ = ppo_loss(actor_config("verl", use_kl_loss=True), model_output, data)
    assert ours.item() == pytest.approx(verls.item(), abs=1e-9)
    # verl's KL covers every response token (5 here), the reference's only the 4 masked-in ones.
    verl_kl = ours.item() - _pg_only("verl")
    assert verl_kl > 0
    assert verl_kl != pytest.approx(EXPECTED_KL_TERM, abs=1e-8)


def _pg_only(normalization):
    data, model_output = actor_batch()
    return ppo_loss(actor_config(normalization), model_output, data)[0].item()


def test_invalid_loss_settings_fail_when_the_config_is_built():
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.prob_mask\.normalization must be one of \['reference', 'verl'\]"):
        SPOPolicyLossConfig(loss_mode="spo_prob_mask", spo={"prob_mask": {"normalization": "token-mean"}})
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.prob_mask\.threshold must be a number in \(0, 1\]"):
        SPOPolicyLossConfig(loss_mode="spo_prob_mask", spo={"prob_mask": {"threshold": 2}})


def test_plain_policy_loss_config_uses_the_papers_defaults():
    config = actor_config(policy_loss_cls=PolicyLossConfig)
    loss, _ = get_policy_loss_fn("spo_prob_mask")(
        OLD_LOG_PROB, LOG_PROB, ADVANTAGES, RESPONSE_MASK.bool(), "token-mean", config, None
    )
    assert loss.item() == pytest.approx(EXPECTED_PG_LOSS, abs=1e-6)


def test_a_mini_batch_with_nothing_to_train_gives_zero_loss_and_gradient():
    """SPO-tree drops zero-advantage segments: a mini-batch can end with no trained token at all."""
    for normalization in ("reference", "verl"):
        data, model_output = actor_batch()
        data["response_mask"] = torch.zeros_like(data["response_mask"])
        data["loss_mask"] = data["response_mask"]
        tu.assign_non_tensor(data, batch_num_tokens=0)
        loss, _ = spo_ppo_loss(actor_config(normalization, use_kl_loss=False), model_output, data)
        assert loss.item() == 0.0
        loss.backward()
        assert (model_output["log_probs"].grad.values() == 0).all()
    data, model_output = actor_batch()
    data["response_mask"] = torch.zeros_like(data["response_mask"])
    tu.assign_non_tensor(data, batch_num_tokens=0)
    loss, _ = spo_ppo_loss(actor_config("reference", use_kl_loss=True), model_output, data)
    assert loss.item() == 0.0
