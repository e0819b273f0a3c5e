"""The cluster settings against the SPO reference's configs (AIFrameResearch/SPO at b9fc6a2), value by value
(docs/FIDELITY.md, items 11, 16, 19, 20 and 21): each shipped setting with each algorithm, composed as the
run scripts compose it (the recipe's Hydra config with ``setting=`` and ``spo_algorithm=`` only), and the two
headline runs through the scripts themselves. verl's own checks of every combination are in
test_recipe_on_cpu.py (test_every_setting_composes_with_every_algorithm)."""

import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from spo_verl.adapters import config_resolvers

REPO = Path(__file__).resolve().parents[1]
RECIPE_CONFIG = REPO / "recipe" / "spo" / "config"
ALGORITHMS = sorted(path.stem for path in (RECIPE_CONFIG / "spo_algorithm").glob("*.yaml"))
CLUSTER_SETTINGS = sorted(path.stem for path in (RECIPE_CONFIG / "setting").glob("*.yaml")
                          if not path.stem.startswith("cpu-"))
STOP = ["\n\n\nProblem:"]


def shipped(compose_setting, setting, algorithm):
    config = compose_setting(setting, algorithm)
    OmegaConf.resolve(config)
    return config


def most_optimizer_steps(config) -> int:
    """verl's optimizer steps in one iteration when every row is trained: mini-batches of prompts times
    passes (an SPO tree keeps fewer rows when leaves agree, docs/FIDELITY.md item 17)."""
    actor = config.actor_rollout_ref.actor
    assert config.data.train_batch_size % actor.ppo_mini_batch_size == 0
    return config.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs


def test_every_cluster_setting_is_covered():
    assert CLUSTER_SETTINGS == ["gsm8k-rhomath-1.1b", "math-r1-1.5b"]
    assert {"spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo", "grpo_prob_mask", "ppo"} <= set(ALGORITHMS)


@pytest.mark.parametrize("algorithm", ["spo_tree", "spo_tree_cutpoint"])
def test_gsm8k_spo_tree_takes_the_references_prompts_passes_and_steps(compose_setting, algorithm):
    # configs/polIter_rho1bSft2_spo_tree_GSM8K.jsonnet: 16 prompts an iteration (line 3), one epoch (line 26),
    # 1,024 edges (line 1) in mini-batches of 128 (line 28): 8 optimizer steps. A verl row is a leaf, and
    # a mini-batch counts trees, so 2 trees a mini-batch give at most those 8 steps (the cutpoint tree is
    # batched as the fixed tree it is compared with).
    config = shipped(compose_setting, "gsm8k-rhomath-1.1b", algorithm)
    actor = config.actor_rollout_ref.actor
    assert (config.data.train_batch_size, actor.ppo_epochs, actor.ppo_mini_batch_size) == (16, 1, 2)
    assert most_optimizer_steps(config) == 1024 // 128
    # A tree's leaf rows vary in number: micro-batches by tokens (docs/FIDELITY.md item 6).
    assert actor.use_dynamic_bsz is True and actor.ppo_micro_batch_size_per_gpu is None
    if algorithm == "spo_tree":  # the reference's 6-6-6 tree with M = 30 (lines 12-21)
        assert list(config.algorithm.spo.tree.branching) == [6, 6, 6]
        assert list(config.algorithm.spo.tree.segment_tokens) == [30, 30]
        assert config.actor_rollout_ref.rollout.n == 216


def test_math_spo_tree_keeps_the_references_32_trees_in_4_steps(compose_setting):
    # configs/polIter_qwen1b_spo_tree_MATH.jsonnet: 32 prompts (line 3), 512 edges (line 1) in
    # mini-batches of 128 (line 31), one epoch (line 29).
    config = shipped(compose_setting, "math-r1-1.5b", "spo_tree")
    assert config.data.train_batch_size == 32 and config.actor_rollout_ref.actor.ppo_epochs == 1
    assert most_optimizer_steps(config) == 512 // 128


def test_math_spo_chain_takes_the_references_batch_and_monte_carlo_samples(compose_setting):
    # configs/polIter_qwen1b_spo_chain_MATH.jsonnet: 512 answers, 8 a prompt, so 64 prompts (lines 7-9);
    # mini-batches of 128 answers (line 163), one epoch (line 146); 4 Monte Carlo continuations a
    # boundary (lines 14 and 111).
    config = shipped(compose_setting, "math-r1-1.5b", "spo_chain")
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert (config.data.train_batch_size, rollout.n) == (64, 8)
    assert actor.ppo_mini_batch_size * rollout.n == 128 and actor.ppo_epochs == 1
    assert most_optimizer_steps(config) == 512 // 128
    assert config.algorithm.spo.chain.mc_samples == 4
    assert actor.policy_loss.spo.chain.mc_samples == 4  # the loss's copy of the SPO settings agrees


def test_gsm8k_spo_chain_keeps_the_references_nine_samples_and_two_passes(compose_setting):
    # configs/episode_generators/9rolls.jsonnet (imported by polIter_rho1bSft2_spo_chain_MATH.jsonnet,
    # line 99, and so by the GSM8K chain); 64 prompts x 8 and 2 epochs from polIter_rho1bSft2_ppo_MATH.jsonnet
    # (lines 13-15) and trainers/ppo_MATH.jsonnet (line 92).
    config = shipped(compose_setting, "gsm8k-rhomath-1.1b", "spo_chain")
    assert config.algorithm.spo.chain.mc_samples == 9
    assert (config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_epochs) == (64, 2)


@pytest.mark.parametrize("setting", CLUSTER_SETTINGS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_request_stops_at_the_next_problem_and_the_reward_reads_before_it(compose_setting, setting, algorithm):
    # RhoMath: polIter_rho1bSft2_ppo_MATH.jsonnet line 69 (every RhoMath config imports it). R1-Distill:
    # polIter_qwen1b_spo_chain_MATH.jsonnet line 82 (the tree and GRPO configs import it) and
    # qwen1b_for_MATH_eval.jsonnet line 24; its program template (prompt_library/qwen_MATH.jsonnet) passes
    # `stop` on to vLLM, whatever the comment beside it says.
    config = shipped(compose_setting, setting, algorithm)
    assert list(config.actor_rollout_ref.rollout.custom.stop) == STOP
    assert list(config.reward.custom_reward_function.reward_kwargs.stop) == STOP


@pytest.mark.parametrize("setting", CLUSTER_SETTINGS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_critic_trains_with_the_actors_optimiser_settings(compose_setting, setting, algorithm):
    # trainers/ppo_MATH.jsonnet: one learning rate 1e-6, weight decay 0, 3 % warm-up (lines 72-74) and value
    # clip 0.2 (line 61); src/treetune/trainers/ppo_trainer.py builds the critic's optimiser and schedule
    # from the same arguments as the actor's. verl's critic defaults would be 1e-5, constant, decay 0.01.
    config = shipped(compose_setting, setting, algorithm)
    actor, critic = config.actor_rollout_ref.actor.optim, config.critic.optim
    assert critic.lr == pytest.approx(1e-6) and critic.lr == actor.lr
    for key in ("lr_warmup_steps_ratio", "weight_decay", "lr_scheduler_type", "min_lr_ratio"):
        assert critic[key] == actor[key], key
    assert (critic.lr_warmup_steps_ratio, critic.weight_decay) == (0.03, 0.0)
    assert config.critic.cliprange_value == pytest.approx(0.2)


@pytest.mark.parametrize("setting", CLUSTER_SETTINGS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_references_iterations_and_epochs_enough_for_them(compose_setting, setting, algorithm):
    # 1,000 iterations (polIter_rho1bSft2_spo_chain_GSM8K.jsonnet line 3, polIter_qwen1b_spo_chain_MATH.jsonnet
    # line 10), 650 for PPO on GSM8K (polIter_rho1bSft2_ppo_GSM8K.jsonnet line 3). The reference draws each
    # iteration's prompts anew (dataset_sample_with_replacement, polIter_rho1bSft2_ppo_MATH.jsonnet line 37);
    # verl shuffles epochs and stops after the last, so the epochs must hold the iterations: GSM8K's 7,473
    # training problems, and MATH's 7,500 as long as the prompt filter keeps 3,200 (docs/FIDELITY.md item 20).
    config = shipped(compose_setting, setting, algorithm)
    trainer = config.trainer
    expected = 650 if (setting, algorithm) == ("gsm8k-rhomath-1.1b", "ppo") else 1000
    assert trainer.total_training_steps == expected
    assert config.data.shuffle is True
    problems = 7473 if setting.startswith("gsm8k") else 3200
    assert trainer.total_epochs * (problems // config.data.train_batch_size) >= trainer.total_training_steps


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A run script as a user runs it from another folder; the launcher picks the Python that composes."""
    environment = {**os.environ, **env}
    environment.pop("PYTHON", None)
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=environment, capture_output=True,
                          text=True, timeout=300, cwd="/")


def printed_config(output: str):
    config_resolvers.install()  # the recipe's resolvers (rollout.n from the tree's shape)
    config = OmegaConf.create("\n".join(line for line in output.splitlines() if not line.startswith("spo: ")))
    OmegaConf.resolve(config)
    return config


def test_the_run_scripts_compose_the_references_batches():
    tree = run_script("run_spo_tree.sh", "--cfg", "job", SETTING="gsm8k-rhomath-1.1b")
    assert tree.returncode == 0, tree.stderr[-2000:]
    config = printed_config(tree.stdout)
    assert config.algorithm.adv_estimator == "spo_tree" and config.actor_rollout_ref.rollout.n == 216
    assert (config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_epochs) == (16, 1)
    assert most_optimizer_steps(config) == 8

    chain = run_script("run_spo_chain.sh", "--cfg", "job", SETTING="math-r1-1.5b")
    assert chain.returncode == 0, chain.stderr[-2000:]
    config = printed_config(chain.stdout)
    assert config.algorithm.adv_estimator == "spo_chain" and config.algorithm.spo.chain.mc_samples == 4
    assert config.data.train_batch_size == 64 and most_optimizer_steps(config) == 4
    assert list(config.actor_rollout_ref.rollout.custom.stop) == STOP
    assert config.critic.optim.lr == pytest.approx(1e-6)
