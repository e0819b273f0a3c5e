"""The cluster settings against the SPO reference's own runs (docs/FIDELITY.md, "Like for like"): each
value the reference sets for a baseline, a validation or its data is asserted on the configuration as a
cluster job composes it."""

import pytest
from omegaconf import OmegaConf

ALGORITHMS = ("spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo", "grpo_prob_mask", "ppo")


def resolved(compose_setting, setting, algorithm, *overrides):
    config = compose_setting(setting, algorithm, *overrides)
    OmegaConf.resolve(config)
    return config


def optimizer_steps_per_iteration(config) -> float:
    """verl's optimizer steps in one training step when every sampled row is trained: the batch's rows over
    the mini-batch's, times the epochs."""
    actor = config.actor_rollout_ref.actor
    return config.data.train_batch_size / actor.ppo_mini_batch_size * actor.ppo_epochs


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_prob_mask"])
def test_grpo_on_math_samples_the_references_batch(compose_setting, algorithm):
    """64 prompts x 8 answers an iteration, mini-batches of 128 answers: 4 optimizer steps, as the
    reference's GRPO and its SPO-tree (512 rows in mini-batches of 128)."""
    config = resolved(compose_setting, "math-r1-1.5b", algorithm)
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    assert (config.data.train_batch_size, rollout.n) == (64, 8)
    assert actor.ppo_mini_batch_size * rollout.n == 128 and actor.ppo_epochs == 1
    assert optimizer_steps_per_iteration(config) == 4
    # SPO-tree keeps its 32 trees of 216 leaves (the reference's 32 prompts).
    tree = resolved(compose_setting, "math-r1-1.5b", "spo_tree")
    assert tree.data.train_batch_size == 32 and optimizer_steps_per_iteration(tree) == 4


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_prob_mask", "spo_chain"])
def test_gsm8k_samples_the_references_batch(compose_setting, algorithm):
    """64 prompts x 8 an iteration, mini-batches of 64 answers, micro-batches of 8, 2 epochs: 16 steps."""
    config = resolved(compose_setting, "gsm8k-rhomath-1.1b", algorithm)
    actor = config.actor_rollout_ref.actor
    assert (config.data.train_batch_size, config.actor_rollout_ref.rollout.n) == (64, 8)
    assert actor.ppo_mini_batch_size * 8 == 64 and actor.ppo_micro_batch_size_per_gpu == 8
    assert optimizer_steps_per_iteration(config) == 16


def test_grpo_can_be_whitened_per_micro_batch_as_the_reference_does(compose_setting):
    """The reference trains GRPO with SPO's loss, whitened per micro-batch, without the probability mask:
    ``grpo_prob_mask`` with ``prob_mask.threshold=null`` (the loss itself: test_policy_loss_on_cpu.py)."""
    from spo_verl.core.config import parse_spo_settings

    config = resolved(compose_setting, "math-r1-1.5b", "grpo_prob_mask", "algorithm.spo.prob_mask.threshold=null")
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "spo_prob_mask"
    settings = parse_spo_settings(OmegaConf.to_container(config.algorithm.spo))
    assert settings.prob_mask.threshold is None and settings.prob_mask.normalization == "reference"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_validation_is_the_references(compose_setting, algorithm):
    """MATH500 (and AIME24) greedily, one answer a problem; GSM8K 16 answers a problem at T 0.35, their
    mean accuracy (its generation program sends no top_p: 1)."""
    math = resolved(compose_setting, "math-r1-1.5b", algorithm).actor_rollout_ref.rollout.val_kwargs
    assert (math.do_sample, math.temperature, math.n) == (False, 0, 1)
    gsm8k = resolved(compose_setting, "gsm8k-rhomath-1.1b", algorithm).actor_rollout_ref.rollout.val_kwargs
    assert (gsm8k.do_sample, gsm8k.temperature, gsm8k.top_p, gsm8k.top_k, gsm8k.n) == (True, 0.35, 1.0, -1, 16)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_math_keeps_the_references_problems(compose_setting, algorithm):
    """The reference keeps the MATH problems whose prompt in its template has at most 200 tokens; verl's
    overlong-prompt filter drops the rest of the rendered prompts when it loads the data."""
    config = resolved(compose_setting, "math-r1-1.5b", algorithm)
    assert config.data.max_prompt_length == 200 and config.data.filter_overlong_prompts is True
    assert config.data.prompt_key == "bare_prompt" and "Solve the following math problem" in (
        config.actor_rollout_ref.model.custom_chat_template)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_both_settings_stop_at_the_next_problem_and_score_before_it(compose_setting, algorithm):
    """RhoMath writes the next problem after its answer; the reference sends the same stop string to R1
    on MATH too (its MATH configs set it in the node expander's program arguments)."""
    for setting in ("gsm8k-rhomath-1.1b", "math-r1-1.5b"):
        config = resolved(compose_setting, setting, algorithm)
        assert list(config.actor_rollout_ref.rollout.custom.stop) == ["\n\n\nProblem:"], setting
        assert list(config.reward.custom_reward_function.reward_kwargs.stop) == ["\n\n\nProblem:"], setting
