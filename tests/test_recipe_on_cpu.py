"""The SPO recipe composes against verl 0.9.1's real configuration tree, passes verl's own validation
for every algorithm choice, and the launch scripts print what they would run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from spo_verl.adapters.policy_loss import SPOPolicyLossConfig
from recipe.spo.checks_before_ray.configuration import validate_spo_run

REPO = Path(__file__).resolve().parents[1]
RECIPE_CONFIG = str(REPO / "recipe" / "spo" / "config")
ALGORITHMS = ["spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo", "grpo_prob_mask", "ppo"]
# The run scripts' cluster setting as shipped (run_spo_tree.sh's default): each test composes what a user's
# launch composes, its own overrides on top.
CLUSTER = ["setting=math-r1-1.5b"]


def compose_recipe(*overrides):
    with initialize_config_dir(config_dir=RECIPE_CONFIG, version_base=None):
        config = compose(config_name="spo_trainer", overrides=[*CLUSTER, *overrides])
    OmegaConf.resolve(config)
    return config


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_composes_and_passes_verls_validation(algorithm, tiny_model):
    # A real local model: verl's validation loads the critic's model config for ppo.
    config = compose_recipe(f"spo_algorithm={algorithm}", f"actor_rollout_ref.model.path={tiny_model[0]}")
    validate_spo_run(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, SPOPolicyLossConfig)
    assert actor.use_kl_loss and actor.kl_loss_coef == pytest.approx(1e-4)
    expected = {
        "spo_tree": ("spo_tree", "spo_tree", "spo_prob_mask", 216),
        "spo_tree_cutpoint": ("spo_tree", "spo_tree", "spo_prob_mask", 20),
        "spo_chain": ("spo_chain", "spo_chain", "spo_prob_mask", 8),
        "grpo": ("grpo", "single_turn_agent", "vanilla", 8),
        "grpo_prob_mask": ("grpo", "single_turn_agent", "spo_prob_mask", 8),
        "ppo": ("gae", "single_turn_agent", "vanilla", 8),
    }[algorithm]
    got = (
        config.algorithm.adv_estimator,
        config.actor_rollout_ref.rollout.agent.default_agent_loop,
        config.actor_rollout_ref.actor.policy_loss.loss_mode,
        config.actor_rollout_ref.rollout.n,
    )
    assert got == expected
    assert need_critic(config) == (algorithm == "ppo")
    if algorithm == "ppo":
        assert config.critic.model.path == tiny_model[0]


def test_every_documented_setting_is_in_the_entry_points_config_with_its_documented_default():
    """docs/SETTINGS.md's table: each ``algorithm.spo`` key can be overridden without Hydra's ``+`` (the
    composed config is struct-locked) and starts at the default the table gives (SPO-tree's bundle)."""
    import yaml

    table = re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)`", (REPO / "docs" / "SETTINGS.md").read_text(), re.M)
    assert len(table) >= 30
    spo = compose_recipe("spo_algorithm=spo_tree").algorithm.spo
    for key, default in table:
        value = OmegaConf.select(spo, key, default=KeyError)
        assert value is not KeyError, f"algorithm.spo.{key} is documented but not in spo_trainer.yaml"
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        assert value == yaml.safe_load(default), (key, value, default)


def test_rollout_n_follows_the_tree_shape():
    config = compose_recipe("algorithm.spo.tree.branching=[4,5,6]", "algorithm.spo.tree.segment_tokens=[30,30]")
    assert config.actor_rollout_ref.rollout.n == 120
    validate_spo_run(config)
    # A cutpoint tree: the most leaves its settings allow, 4 responses x (1 + 2 forks x 2 continuations).
    config = compose_recipe("algorithm.spo.tree.branch_at=cutpoint")
    assert config.actor_rollout_ref.rollout.n == 20
    validate_spo_run(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.spo.tree.branching=[6,0,6]"], r"algorithm\.spo\.tree\.branching\[1\] must be a positive integer"),
        (["algorithm.spo.tree.segment_tokens=[900,900]", "data.max_response_length=1536"],
         r"segment_tokens \[900, 900\] use 1800 tokens"),
        (["actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent"], r"adv_estimator=spo_tree needs actor_rollout_ref\.rollout\.agent\.default_agent_loop=spo_tree"),
        (["trainer.v1.trainer_mode=sync"], r"needs trainer\.v1\.trainer_mode=spo"),
        (["actor_rollout_ref.rollout.agent.default_agent_loop=nope"], r"default_agent_loop=nope is not a registered agent loop"),
        (["algorithm.spo.tree.branch_at=cutpoint", "actor_rollout_ref.rollout.n=8"],
         r"branch_at=cutpoint with responses=4, max_forks=2, width=2, rounds=1 can sample up to 20 leaves a prompt, more "
         r"than actor_rollout_ref\.rollout\.n=8"),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"],
         r"^actor_rollout_ref\.rollout\.log_prob_use_dynamic_bsz=False differs from actor_rollout_ref\.actor\.use_dynamic_bsz=True: "
         r"verl's actor worker computes the old log-probs with the update's micro-batching"),
        (["algorithm.spo.tree.branch_at=forks"], r"algorithm\.spo\.tree\.branch_at must be one of \['fixed', 'cutpoint', 'turn'\]"),
        (["algorithm.spo.tree.align_to_block=0"], r"algorithm\.spo\.tree\.align_to_block must be a positive integer, got 0"),
        # 760 + 760 plus up to 15 tokens of alignment at depth 1 and 8 at depth 2 would reach 1543 of 1536.
        (["algorithm.spo.tree.segment_tokens=[760,760]", "algorithm.spo.tree.align_to_block=16", "data.max_response_length=1536"],
         r"segment_tokens \[760, 760\] aligned to algorithm\.spo\.tree\.align_to_block=16 can use 1543 tokens"),
        (["algorithm.spo.prob_mask.normalization=mean"], r"prob_mask\.normalization must be one of \['reference', 'verl'\]"),
        # verl's legacy manager cuts the repeated batch into num_workers chunks: 2 prompts over 8 workers
        # would cut each prompt's tree in four.
        (["trainer.use_v1=false", "data.train_batch_size=2", "actor_rollout_ref.rollout.agent.num_workers=8"],
         r"data\.train_batch_size \(2\) to be a multiple of actor_rollout_ref\.rollout\.agent\.num_workers \(8\)"),
        (["spo_algorithm=spo_chain", "trainer.use_v1=false", "data.train_batch_size=6", "actor_rollout_ref.rollout.agent.num_workers=4"],
         r"default_agent_loop=spo_chain on the legacy trainer needs data\.train_batch_size \(6\)"),
        # Packed training (every algorithm): refused where the packed forward would not be verl's.
        (["algorithm.spo.packing.enable=true", "actor_rollout_ref.actor.strategy=megatron"],
         r"packing\.enable=true needs verl's FSDP engine: actor_rollout_ref\.actor\.strategy must be fsdp or fsdp2 \(got megatron\)"),
        (["spo_algorithm=grpo", "algorithm.spo.packing.enable=true", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
         r"does not support sequence parallelism: actor_rollout_ref\.actor\.ulysses_sequence_parallel_size must be 1 \(got 2\)"),
        (["algorithm.spo.packing.enable=true", "actor_rollout_ref.model.use_fused_kernels=true"],
         r"does not support actor_rollout_ref\.model\.use_fused_kernels=True; turn it off"),
        (["spo_algorithm=spo_chain", "algorithm.spo.packing.enable=true", "actor_rollout_ref.model.lora_rank=8"],
         r"does not support actor_rollout_ref\.model\.lora_rank=8; turn it off"),
        (["algorithm.spo.packing.enable=yes"], r"algorithm\.spo\.packing\.enable must be true or false"),
        (["algorithm.spo.packing.chunk_tokens=0"], r"algorithm\.spo\.packing\.chunk_tokens must be a positive integer, got 0"),
        # verl's bypass mode (rollout log-probs as old log-probs) would swap SPO's loss out on the legacy trainer.
        (["spo_algorithm=grpo_prob_mask", "trainer.use_v1=false", "algorithm.rollout_correction.bypass_mode=true"],
         r"bypass_mode=true on the legacy trainer \(trainer\.use_v1=false\) replaces actor_rollout_ref\.actor\.policy_loss\.loss_mode=spo_prob_mask"),
        (["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"],
         r"bypass_mode=true takes the rollout's log-probs as the old log-probs: set actor_rollout_ref\.rollout\.calculate_log_probs=true"),
        # Multi-turn episodes: an environment that exists, turns that leave room for a reply.
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn"],
         r"algorithm\.spo\.chain\.partition=turn needs algorithm\.spo\.turns\.environment"),
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=calculater"],
         r"algorithm\.spo\.turns\.environment must be one of \['arithmetic_dialogue'\] or module:attribute, got 'calculater'"),
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=arithmetic_dialogue",
          "algorithm.spo.turns.max_turn_tokens=100000"],
         r"algorithm\.spo\.turns\.max_turn_tokens=100000 leaves no room in actor_rollout_ref\.rollout\.response_length="),
        # A context shorter than prompt + response: verl's server would shorten late turns, then refuse one.
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=arithmetic_dialogue",
          "data.max_prompt_length=100", "data.max_response_length=60", "+actor_rollout_ref.rollout.max_model_len=150"],
         r"actor_rollout_ref\.rollout\.max_model_len=150 is less than the prompt and response it must hold: "
         r"data\.max_prompt_length \(100\) \+ data\.max_response_length \(60\) = 160"),
        (["algorithm.spo.tree.branch_at=turn"], r"algorithm\.spo\.tree\.branch_at=turn needs algorithm\.spo\.turns\.environment"),
        (["algorithm.spo.tree.branch_at=turn", "algorithm.spo.turns.environment=arithmetic_dialogue", "algorithm.spo.turns.max_turns=2"],
         r"algorithm\.spo\.tree\.branching=\[6, 6, 6\] with branch_at=turn branches after 2 turns and plays at least one more: "
         r"raise algorithm\.spo\.turns\.max_turns \(2\)"),
        # verl's tools as the environment: tools to load, a parser verl has for their format.
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=verl_tools"],
         r"algorithm\.spo\.turns\.environment=verl_tools needs tools: set actor_rollout_ref\.rollout\.multi_turn\.tool_config_path "
         r"or function_tool_path"),
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=verl_tools",
          "actor_rollout_ref.rollout.multi_turn.function_tool_path=/nonexistent/tools.py", "actor_rollout_ref.rollout.multi_turn.format=hermez"],
         r"actor_rollout_ref\.rollout\.multi_turn\.format=hermez is not one of verl's tool parsers: \[.*'hermes'"),
        (["spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn", "algorithm.spo.turns.environment=verl_tools",
          "actor_rollout_ref.rollout.multi_turn.function_tool_path=/nonexistent/tools.py"],
         r"actor_rollout_ref\.rollout\.multi_turn tools cannot be loaded .*/nonexistent/tools\.py"),
        # An environment the run would ignore: its rollout samples single-turn responses.
        (["spo_algorithm=spo_chain", "algorithm.spo.turns.environment=nonexistent_env"],
         r"algorithm\.spo\.turns\.environment=nonexistent_env would be ignored: only multi-turn episodes use it "
         r"\(algorithm\.spo\.chain\.partition=turn with spo_chain, .*this run \(algorithm\.adv_estimator=spo_chain, "
         r"default_agent_loop=spo_chain\) samples single-turn responses"),
        (["spo_algorithm=grpo", "algorithm.spo.turns.environment=arithmetic_dialogue"],
         r"algorithm\.spo\.turns\.environment=arithmetic_dialogue would be ignored: .*\(algorithm\.adv_estimator=grpo, "
         r"default_agent_loop=single_turn_agent\)"),
        # verl's estimators on the episode loop need the environment too.
        (["spo_algorithm=grpo", "actor_rollout_ref.rollout.agent.default_agent_loop=spo_episode"],
         r"default_agent_loop=spo_episode\) need algorithm\.spo\.turns\.environment"),
    ],
)
def test_invalid_runs_fail_at_configuration_time(overrides, message):
    # A bad tree shape already fails while rollout.n is resolved from it; the message is the same.
    with pytest.raises((ValueError, InterpolationResolutionError), match=message):
        validate_spo_run(compose_recipe(*overrides))


def test_multi_turn_episodes_need_a_chat_template_that_ends_a_turn_with_eos(tiny_model, tmp_path):
    model_dir, tokenizer = tiny_model
    turns = ("spo_algorithm=spo_chain", "algorithm.spo.chain.partition=turn",
             "algorithm.spo.turns.environment=arithmetic_dialogue")
    validate_spo_run(compose_recipe(*turns, f"actor_rollout_ref.model.path={model_dir}"))
    tokenizer.save_pretrained(tmp_path)
    plain = tmp_path / "tokenizer_config.json"
    settings = json.loads(plain.read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    plain.write_text(json.dumps(settings))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="the chat template does not end an assistant turn with the EOS token"):
        validate_spo_run(compose_recipe(*turns, f"actor_rollout_ref.model.path={tmp_path}"))


@pytest.mark.parametrize(
    ("overrides", "warning"),
    [
        ([], None),  # 600-token segments against vLLM's 16-token GPU blocks
        (["algorithm.spo.tree.segment_tokens=[8,600]"], r"segment_tokens \[8, 600\] has segments shorter than the "
         r"rollout engine's KV-cache block \(16 tokens\).*align_to_block=16"),
        (["algorithm.spo.tree.segment_tokens=[20,600]", "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=32"],
         r"shorter than the rollout engine's KV-cache block \(32 tokens\)"),
        (["algorithm.spo.tree.segment_tokens=[8,600]", "algorithm.spo.tree.align_to_block=16"], None),
        (["algorithm.spo.tree.align_to_block=32"], r"align_to_block=32 differs from the rollout engine's KV-cache block size 16"),
        (["trainer.device=cpu", "algorithm.spo.tree.segment_tokens=[100,600]"], r"block \(128 tokens\)"),  # vLLM's CPU default
    ],
)
def test_segments_shorter_than_a_cache_block_are_warned_about_at_configuration_time(overrides, warning, caplog):
    with caplog.at_level("WARNING", logger="recipe.spo.checks_before_ray.configuration"):
        validate_spo_run(compose_recipe(*overrides))
    messages = [record.getMessage() for record in caplog.records if record.name == "recipe.spo.checks_before_ray.configuration"]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and re.search(warning, messages[0]), messages


def run_script(script, *args, python=sys.executable, **env):
    """A run script in a clean working directory; ``python=None`` leaves the launcher to choose."""
    environment = {**os.environ, **env}
    environment.pop("PYTHON", None)
    if python is not None:
        environment["PYTHON"] = python
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=environment, capture_output=True,
                          text=True, timeout=300, cwd="/")


def a_cluster_python3_that_must_not_run(folder: Path) -> str:
    """A ``python3`` first on PATH that fails loudly: composing a GPU setting offline must use the
    set-up script's .venv, and only a GPU run the cluster's Python."""
    shim = folder / "python3"
    shim.write_text("#!/bin/sh\necho \"cluster python3 ran: $*\" >&2\nexit 7\n")
    shim.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def assert_prompt_format(printed: str, name: str) -> None:
    """The setting writes its prompts as ``recipe/spo/config/prompt_format/<name>.yaml`` says (its text
    against the reference's: tests/test_prompt_formats_on_cpu.py)."""
    config = OmegaConf.create("\n".join(config_lines(printed)))
    expected = OmegaConf.load(Path(RECIPE_CONFIG) / "prompt_format" / f"{name}.yaml")
    assert config.data.prompt_key == expected.data.prompt_key == "bare_prompt"
    assert config.actor_rollout_ref.model.custom_chat_template == expected.actor_rollout_ref.model.custom_chat_template


def assert_set_for_a_long_cluster_run(printed: str) -> None:
    """What a run of days on several nodes needs, in a printed ``--cfg job`` configuration."""
    config = OmegaConf.create("\n".join(config_lines(printed)))
    assert config.data.filter_overlong_prompts is True
    actor = config.actor_rollout_ref.actor
    longest = config.data.max_prompt_length + config.data.max_response_length
    update_budget = actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else actor.ppo_micro_batch_size_per_gpu * longest
    for role in ("rollout", "ref"):
        passes = config.actor_rollout_ref[role]
        # verl's actor worker asserts that the old-log-prob pass micro-batches as the update does.
        assert passes.log_prob_use_dynamic_bsz is actor.use_dynamic_bsz, role
        if actor.use_dynamic_bsz:  # no gradients: a larger budget
            assert passes.log_prob_max_token_len_per_gpu > update_budget, role
        else:
            assert passes.log_prob_micro_batch_size_per_gpu > actor.ppo_micro_batch_size_per_gpu, role
    assert config.trainer.max_actor_ckpt_to_keep == 2 and config.trainer.resume_mode == "auto"
    assert config.trainer.total_training_steps == 1000  # the reference's iterations: the schedule spans them
    # Named by the experiment (the variables every Ray worker is given are the entry point's: driver_config.py).
    assert config.trainer.default_local_dir == f"{REPO}/checkpoints/spo/{config.trainer.experiment_name}"


def config_lines(output):
    return [line for line in output.splitlines() if not line.startswith("spo: ")]


def test_run_spo_tree_cfg_job_shows_the_algorithm_and_starts_nothing(tmp_path):
    result = run_script("run_spo_tree.sh", "--cfg", "job", python=None, SETTING="math-r1-1.5b",
                        PATH=a_cluster_python3_that_must_not_run(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "adv_estimator: spo_tree" in out
    assert "default_agent_loop: spo_tree" in out
    assert "loss_mode: spo_prob_mask" in out
    assert "_target_: spo_verl.adapters.policy_loss.SPOPolicyLossConfig" in out
    assert "branching:\n      - 6\n      - 6\n      - 6" in out
    assert re.search(r"logs -> console, tensorboard at /\S+ and /\S+\.jsonl; checkpoints -> "
                     + re.escape(f"{REPO}/checkpoints/spo/math-r1-1.5b-spo_tree"), out)
    assert "Started a local Ray instance" not in result.stderr
    assert_set_for_a_long_cluster_run(out)
    assert_prompt_format(out, "r1_math")


def _flat(printed_lines: list[str]) -> dict[str, object]:
    """A printed ``--cfg job`` configuration as dotted keys (interpolations unresolved)."""
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk(OmegaConf.to_container(OmegaConf.create("\n".join(printed_lines)), resolve=False), "")
    return flat


def test_grpo_differs_from_spo_tree_only_in_the_algorithm_parts():
    same = dict(EXPERIMENT_NAME="same", VERL_FILE_LOGGER_PATH="/tmp/same.jsonl", SETTING="math-r1-1.5b")
    tree = _flat(config_lines(run_script("run_spo_tree.sh", "--cfg", "job", **same).stdout))
    grpo = _flat(config_lines(run_script("run_grpo.sh", "--cfg", "job", **same).stdout))
    assert len(grpo) > 500
    differing = {key: (tree.get(key), grpo.get(key)) for key in tree.keys() | grpo.keys() if tree.get(key) != grpo.get(key)}
    assert differing == {
        "actor_rollout_ref.actor.policy_loss.loss_mode": ("spo_prob_mask", "vanilla"),
        "actor_rollout_ref.rollout.n": ("${spo_leaf_slots:${algorithm.spo.tree}}", 8),
        "actor_rollout_ref.rollout.agent.default_agent_loop": ("spo_tree", "single_turn_agent"),
        "algorithm.adv_estimator": ("spo_tree", "grpo"),
        "algorithm.spo.tree.branch_at": ("fixed", None),  # the tree's own setting (spo_tree_cutpoint: cutpoint)
        # The reference's GRPO batch on MATH: 64 prompts x 8 in mini-batches of 128 (docs/FIDELITY.md item 12).
        "data.train_batch_size": (32, 64),
        "actor_rollout_ref.actor.ppo_mini_batch_size": (8, 16),
    }


def test_an_invalid_setting_stops_the_entry_point_before_ray_starts():
    result = subprocess.run(
        [sys.executable, "-m", "recipe.spo.main_spo", "algorithm.spo.tree.std_normalize=maybe",
         "actor_rollout_ref.model.path=/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "algorithm.spo.tree.std_normalize must be true or false, got 'maybe'" in result.stderr
    assert "Started a local Ray instance" not in result.stderr + result.stdout


def test_mistyped_registered_names_are_refused_with_the_registered_names():
    """Each name verl looks up in a registry once Ray runs is looked up before, with what is there."""
    cases = [
        ("algorithm.adv_estimator=spo_teee", "algorithm.adv_estimator=spo_teee is not a registered advantage "
         f"estimator; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=spo_prob_mak", "actor_rollout_ref.actor.policy_loss.loss_mode="
         f"spo_prob_mak is not a registered policy loss; registered: {sorted(POLICY_LOSS_REGISTRY)}"),
        ("actor_rollout_ref.rollout.agent.default_agent_loop=spo_teee", "actor_rollout_ref.rollout.agent."
         f"default_agent_loop=spo_teee is not a registered agent loop; registered: {sorted(_agent_loop_registry)}"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError) as refused:
            validate_spo_run(compose_recipe(override))
        assert str(refused.value) == message
    # SPO's names are among those listed, and verl's own.
    assert {"spo_tree", "spo_chain", "grpo", "gae"} <= set(ADV_ESTIMATOR_REGISTRY)
    assert {"spo_prob_mask", "vanilla"} <= set(POLICY_LOSS_REGISTRY)
    assert {"spo_tree", "spo_chain", "single_turn_agent"} <= set(_agent_loop_registry)


REWARD_SOURCE = """
raise RuntimeError("the driver ran the reward file")  # the check reads the source, never runs it
from math import isclose as close_enough

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)

async def score_async(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0

try:
    from fast_scores import tuned_score
except ImportError:
    tuned_score = compute_score
"""


def test_the_reward_function_is_found_in_its_source_without_running_it(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD_SOURCE)

    def reward(path, name):
        return compose_recipe(f"reward.custom_reward_function.path={path}", f"reward.custom_reward_function.name={name}")

    for path, name in [(reward_file, "compute_score"), (f"file://{reward_file}", "score_async"),
                       (reward_file, "tuned_score"), (reward_file, "close_enough"),
                       ("pkg://spo_verl.adapters.rewards", "compute_score"), ("pkg://spo_verl/adapters/rewards", "compute_score")]:
        validate_spo_run(reward(path, name))
    key = "reward.custom_reward_function"
    refusals = [
        ((reward_file, "compute_scor"), f"{key}.name=compute_scor is not defined in {key}.path={reward_file}; its "
         "functions: ['compute_score', 'score_async']"),
        ((tmp_path / "my_rewards.py", "compute_score"), f"{key}.path={tmp_path / 'my_rewards.py'}: no such file"),
        (("pkg://spo_verl.reward", "compute_score"), f"{key}.path=pkg://spo_verl.reward: no module named spo_verl.reward"),
        (("pkg://spo_verl.adapters.rewards", "score"), f"{key}.name=score is not defined in {key}.path=pkg://spo_verl.adapters.rewards; "
         "its functions: ['_gsm8k_correct', '_math_correct', 'before_stop_string', 'compute_score']"),
        (("pkg://no_such_package.rewards", "compute_score"),
         f"{key}.path=pkg://no_such_package.rewards: no module named no_such_package.rewards"),
    ]
    for (path, name), message in refusals:
        with pytest.raises(ValueError) as refused:
            validate_spo_run(reward(path, name))
        assert str(refused.value) == message


def test_names_registered_by_verls_other_routes_are_accepted(tmp_path, monkeypatch):
    """verl also registers agent loops from ``agent_loop_config_path`` and whatever ``external_lib``
    registers when imported: both count, so no valid run is refused."""
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text("- name: my_loop\n  _target_: my_package.MyAgentLoop\n")
    validate_spo_run(compose_recipe("spo_algorithm=grpo", "actor_rollout_ref.rollout.agent.default_agent_loop=my_loop",
                                    f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}"))
    with pytest.raises(ValueError, match=r"agent_loop_config_path=\S+/missing\.yaml: no such file"):
        validate_spo_run(compose_recipe(f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/missing.yaml"))

    (tmp_path / "my_estimator_plugin.py").write_text(
        "from verl.trainer.ppo.core_algos import register_adv_est\n"
        "register_adv_est('my_estimator')(lambda **kwargs: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        validate_spo_run(compose_recipe("spo_algorithm=grpo", "algorithm.adv_estimator=my_estimator",
                                        "actor_rollout_ref.model.external_lib=my_estimator_plugin"))
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("my_estimator", None)
        sys.modules.pop("my_estimator_plugin", None)
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.model\.external_lib=no_such_plugin cannot be imported"):
        validate_spo_run(compose_recipe("actor_rollout_ref.model.external_lib=no_such_plugin"))


def test_the_cluster_settings_names_pass(tiny_model):
    """The names the run scripts' cluster settings use, the reward function included."""
    for algorithm in ALGORITHMS:
        validate_spo_run(compose_recipe(f"spo_algorithm={algorithm}", f"actor_rollout_ref.model.path={tiny_model[0]}",
                                        "reward.custom_reward_function.path=pkg://spo_verl.adapters.rewards",
                                        "reward.custom_reward_function.name=compute_score"))


SETTINGS = sorted(path.stem for path in (Path(RECIPE_CONFIG) / "setting").glob("*.yaml"))


def compose_setting(setting, algorithm, *overrides):
    """A setting as the launcher composes it (a CPU setting with the builder's outputs given)."""
    built = (["data.train_files=t.parquet", "data.val_files=v.parquet", "data.max_prompt_length=100",
              "data.max_response_length=60"] if setting.startswith("cpu-") else [])
    with initialize_config_dir(config_dir=RECIPE_CONFIG, version_base=None):
        config = compose(config_name="spo_trainer", overrides=[f"setting={setting}", f"spo_algorithm={algorithm}", *built,
                                                               *overrides])
    OmegaConf.resolve(config)
    return config


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_setting_composes_with_every_algorithm(setting, tiny_model):
    assert SETTINGS == ["cpu-smollm2", "cpu-tiny", "gsm8k-rhomath-1.1b", "math-r1-1.5b"]
    for algorithm in ALGORITHMS:
        config = compose_setting(setting, algorithm, f"actor_rollout_ref.model.path={tiny_model[0]}")
        validate_spo_run(config)
        # verl's own checks, as the entry point runs them: a setting verl refuses never reaches Ray.
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        actor = config.actor_rollout_ref.actor
        if setting == "gsm8k-rhomath-1.1b":  # the reference whitens over 8 sequences; a tree varies in rows
            tree = algorithm.startswith("spo_tree")
            assert actor.use_dynamic_bsz is tree
            if tree:
                assert actor.ppo_max_token_len_per_gpu == 16384 and actor.ppo_micro_batch_size_per_gpu is None
            else:
                assert actor.ppo_micro_batch_size_per_gpu == 8 and config.critic.ppo_micro_batch_size_per_gpu == 8
        if setting == "cpu-smollm2":  # the builder's lengths
            assert config.actor_rollout_ref.rollout.max_model_len == 160 and config.actor_rollout_ref.rollout.n == 4
        if setting.startswith("cpu-"):  # vLLM's log-probs as the old ones, but not on the legacy trainer
            assert config.algorithm.rollout_correction.bypass_mode is True
            legacy = compose_setting(setting, algorithm, "trainer.use_v1=false")
            assert legacy.algorithm.rollout_correction.bypass_mode is False
        else:
            assert config.trainer.n_gpus_per_node == 8 and actor.optim.lr == pytest.approx(1e-6)


def test_a_mistyped_loss_mode_stops_the_run_script_with_one_line_before_ray(cpu_tiny_cache, tmp_path):
    result = run_script("run_grpo.sh", "actor_rollout_ref.actor.policy_loss.loss_mode=vanila",
                        f"hydra.run.dir={tmp_path / 'hydra'}", SETTING="cpu-tiny", SPO_CPU_CACHE=str(cpu_tiny_cache),
                        VERL_FILE_LOGGER_PATH=str(tmp_path / "metrics.jsonl"), TENSORBOARD_DIR=str(tmp_path / "tb"),
                        CHECKPOINT_DIR=str(tmp_path / "checkpoints"))
    output = result.stdout + result.stderr  # the CPU settings send both through one console filter
    assert result.returncode == 2, output[-3000:]
    last = [line for line in result.stdout.splitlines() if line.strip()][-1]
    assert last.startswith("spo: actor_rollout_ref.actor.policy_loss.loss_mode=vanila is not a registered policy "
                           "loss; registered: ["), output[-3000:]
    assert "'vanilla'" in last and "'spo_prob_mask'" in last
    assert "Traceback" not in output and "Error executing job" not in output
    # Refused before Ray and the trainer: no Ray instance, no metrics file, no checkpoint folder.
    assert "Started a local Ray instance" not in output
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


def test_another_verl_is_named_with_the_list_of_internals_to_check(capsys):
    import verl

    from recipe.spo.checks_before_ray import VERL_WRITTEN_FOR, warn_if_another_verl

    assert verl.__version__ == VERL_WRITTEN_FOR and not warn_if_another_verl()  # the installed verl: silent
    assert capsys.readouterr().err == ""
    assert warn_if_another_verl("0.10.0")
    assert capsys.readouterr().err == ("spo: warning: verl 0.10.0 is installed, spo-verl was written for verl 0.9.1; the "
                                       "verl internals it relies on are listed in docs/VERL_SURFACE.md: check them "
                                       "before trusting a run\n")


def test_a_refusal_is_one_line_and_status_2_unless_spo_debug_is_set(capsys, monkeypatch):
    from recipe.spo.checks_before_ray import check_configuration_or_exit

    monkeypatch.delenv("SPO_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        check_configuration_or_exit(compose_recipe("algorithm.adv_estimator=grp"))
    assert exited.value.code == 2
    assert capsys.readouterr().err == ("spo: algorithm.adv_estimator=grp is not a registered advantage estimator; "
                                       f"registered: {sorted(ADV_ESTIMATOR_REGISTRY)}\n")
    # A check that fails while OmegaConf resolves rollout.n: the check's own message, not OmegaConf's.
    with initialize_config_dir(config_dir=RECIPE_CONFIG, version_base=None):
        unresolved = compose(config_name="spo_trainer", overrides=[*CLUSTER, "algorithm.spo.tree.branching=[6,0,6]"])
    with pytest.raises(SystemExit):
        check_configuration_or_exit(unresolved)
    assert capsys.readouterr().err == "spo: algorithm.spo.tree.branching[1] must be a positive integer, got 0\n"

    monkeypatch.setenv("SPO_DEBUG", "1")
    with pytest.raises(ValueError, match="algorithm.adv_estimator=grp is not a registered advantage estimator"):
        check_configuration_or_exit(compose_recipe("algorithm.adv_estimator=grp"))


def test_run_spo_chain_cfg_job_shows_the_papers_gsm8k_setting(tmp_path):
    result = run_script("run_spo_chain.sh", "algorithm.spo.chain.cutpoint_interval=2", "--cfg", "job", python=None,
                        SETTING="gsm8k-rhomath-1.1b", PATH=a_cluster_python3_that_must_not_run(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for line in ["adv_estimator: spo_chain", "default_agent_loop: spo_chain", "loss_mode: spo_prob_mask",
                 "cutpoint_interval: 2", "mc_samples: 9", "temperature: 0.6", "top_p: 0.9", "ppo_epochs: 2",
                 "train_batch_size: 64", "max_response_length: 1024"]:
        assert line in out, line
    assert f"checkpoints -> {REPO}/checkpoints/spo/gsm8k-rhomath-1.1b-spo_chain" in out
    assert_set_for_a_long_cluster_run(out)
    assert_prompt_format(out, "rho_math_task")


def test_a_run_whose_ray_timed_out_starting_is_started_once_more(capsys):
    """Ray's raylet can miss its fixed 30 s to register on a busy machine, before the run starts: the entry
    point starts it once more, and only then and only once (the failure is injected: Ray cannot be made to
    time out on demand)."""
    from spo_verl.adapters.trainer.runners import RAY_STARTUP_TIMEOUT, run_with_one_restart

    calls = []

    def run(config, task_runner_class, failures):
        calls.append((config, task_runner_class))
        if len(calls) <= failures:
            raise Exception(f"The current node {RAY_STARTUP_TIMEOUT}. This could happen because ...")

    run_with_one_restart(lambda c, task_runner_class: run(c, task_runner_class, 1), "config", "runner")
    assert calls == [("config", "runner")] * 2 and "starting it once more" in capsys.readouterr().out
    calls.clear()
    with pytest.raises(Exception, match=RAY_STARTUP_TIMEOUT):
        run_with_one_restart(lambda c, task_runner_class: run(c, task_runner_class, 2), "config", "runner")
    assert len(calls) == 2
    calls.clear()

    def another_failure(config, task_runner_class):
        calls.append(config)
        raise ValueError("another failure")

    with pytest.raises(ValueError, match="another failure"):
        run_with_one_restart(another_failure, "config", "runner")
    assert len(calls) == 1


def test_before_starting_ray_once_more_the_processes_of_the_timed_out_start_are_stopped(capsys):
    """A timed-out ``ray.init`` leaves its GCS, raylet and helpers running until the driver exits; the
    second start must not run beside them. Stand-ins, since Ray cannot be made to time out on demand:
    children whose command line runs a program inside the ``ray`` package, as Ray's own processes do.
    The one the failed start left is stopped; one that ran before the start and one that is not Ray's
    are left alone."""
    import os
    import subprocess
    import sys

    import ray

    from spo_verl.adapters.trainer.runners import RAY_STARTUP_TIMEOUT, run_with_one_restart

    ray_program = os.path.join(os.path.dirname(os.path.abspath(ray.__file__)), "core", "src", "ray", "raylet", "raylet")
    sleep = "import time; time.sleep(120)"
    children = {"earlier ray": subprocess.Popen([sys.executable, "-c", sleep, ray_program]),
                "not ray": subprocess.Popen([sys.executable, "-c", sleep, "not-ray"])}
    seen_at_second_start = {}

    def run(config, task_runner_class):
        if "left by the start" not in children:
            children["left by the start"] = subprocess.Popen([sys.executable, "-c", sleep, ray_program])
            raise Exception(f"The current node {RAY_STARTUP_TIMEOUT}. This could happen because ...")
        seen_at_second_start.update({name: child.poll() is None for name, child in children.items()})

    try:
        run_with_one_restart(run, "config", "runner")
        assert seen_at_second_start == {"earlier ray": True, "not ray": True, "left by the start": False}
        assert "stopped the 1 process(es) it had started" in capsys.readouterr().out
    finally:
        for child in children.values():
            child.kill()
            child.wait()


def test_the_gsm8k_grpo_and_the_4k_stage_scripts_compose_their_setups(tmp_path):
    # A GPU node: nvidia-smi lists a GPU, so the script's own cluster setting is taken.
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    grpo = run_script("run_grpo_gsm8k.sh", "--cfg", "job", python=None, PATH=a_cluster_python3_that_must_not_run(tmp_path))
    assert grpo.returncode == 0, grpo.stderr[-2000:]
    config = OmegaConf.create("\n".join(config_lines(grpo.stdout)))
    assert config.algorithm.adv_estimator == "grpo" and config.actor_rollout_ref.model.path == "realtreetune/rho-1b-sft-GSM8K"
    assert config.data.train_batch_size == 64 and config.actor_rollout_ref.rollout.n == 8
    assert_prompt_format(grpo.stdout, "rho_math_task")

    refused = run_script("run_spo_tree_math_4k.sh", "--cfg", "job")
    assert refused.returncode == 2 and "set MODEL_PATH to the 2K stage's model" in refused.stderr
    stage = run_script("run_spo_tree_math_4k.sh", "--cfg", "job", MODEL_PATH="/shared/models/spo-tree-2k")
    assert stage.returncode == 0, stage.stderr[-2000:]
    config = OmegaConf.create("\n".join(config_lines(stage.stdout)))
    assert config.actor_rollout_ref.model.path == "/shared/models/spo-tree-2k"
    assert config.data.max_response_length == 3950 and config.algorithm.adv_estimator == "spo_tree"
    assert config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 2 * (200 + 3950)  # follows the lengths
    assert config.trainer.experiment_name == "math-r1-1.5b-spo_tree-4k"
    assert_set_for_a_long_cluster_run(stage.stdout)
