"""The rehearsal of a cluster setting (``scripts/rehearse.sh``) differs from the setting as shipped only in
its declared substitutions and in what follows them through the configuration's interpolations: both
configurations composed and resolved, every key compared. (The rehearsals themselves train through verl's
trainer in tests/test_end_to_end_on_cpu.py.)"""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipe.spo.rehearsal.__main__ import compose_shipped
from recipe.spo.rehearsal.build import FAMILIES
from recipe.spo.rehearsal.substitutions import (BATCH_FACTOR, DERIVED, LENGTH_FACTOR, Substitution, scaled_length,
                                                    substitutions)

ALGORITHMS = ["spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo", "grpo_prob_mask", "ppo"]
MODEL = "/rehearsal/model"


def flat(config) -> dict[str, object]:
    container = OmegaConf.to_container(config, resolve=True)
    found = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            found[prefix] = node

    walk(container, "")
    return found


def test_the_rehearsal_differs_from_the_setting_only_in_its_substitutions(monkeypatch, tmp_path):
    followed = set()
    for setting, algorithm in ((setting, algorithm) for setting in sorted(FAMILIES) for algorithm in ALGORITHMS):
        monkeypatch.setenv("DATA_DIR", "/cluster/data")
        shipped = compose_shipped(setting, algorithm)
        changes = substitutions(shipped, MODEL)
        as_shipped = flat(shipped)
        monkeypatch.setenv("DATA_DIR", str(tmp_path / "rehearsal-data"))
        rehearsed = flat(compose_shipped(setting, algorithm, tuple(change.override() for change in changes)))
        differing = {key for key in as_shipped.keys() | rehearsed.keys() if as_shipped.get(key) != rehearsed.get(key)}
        substituted = {change.key for change in changes}
        assert substituted <= differing, (setting, algorithm, substituted - differing)
        assert differing - substituted <= set(DERIVED), (setting, algorithm, sorted(differing - substituted - set(DERIVED)))
        for change in changes:
            assert rehearsed[change.key] == change.value, change
        followed |= differing - substituted
    assert followed == set(DERIVED)  # the declared list is exact: no key in it that nothing changes


@pytest.mark.parametrize("setting", sorted(FAMILIES))
def test_what_the_rehearsal_keeps_of_the_setting(setting):
    """The tree shape, the micro-batch rules, FSDP, the log-prob passes, validation sampling, checkpoints
    and the optimiser are the setting's; lengths and prompts are scaled by one factor each."""
    for algorithm in ALGORITHMS:
        shipped = compose_shipped(setting, algorithm)
        changes = {change.key: change for change in substitutions(shipped, MODEL)}
        for kept in ("algorithm.spo.tree.branching", "actor_rollout_ref.actor.use_dynamic_bsz",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.strategy",
                     "actor_rollout_ref.ref.strategy", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                     "algorithm.rollout_correction.bypass_mode", "actor_rollout_ref.rollout.val_kwargs.do_sample",
                     "actor_rollout_ref.rollout.temperature", "trainer.resume_mode", "actor_rollout_ref.actor.optim.lr",
                     "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.ppo_epochs",
                     "actor_rollout_ref.rollout.n", "trainer.val_before_train"):
            assert kept not in changes, (algorithm, kept)
        data = shipped.data
        assert changes["data.max_prompt_length"].value == -(-data.max_prompt_length // LENGTH_FACTOR)
        # Not below the rehearsal's own longest prompt: the limit is a filter on the real tokenizer's count.
        floor = substitutions(shipped, MODEL, longest_prompt=data.max_prompt_length // 2)
        assert {change.key: change for change in floor}["data.max_prompt_length"].value == data.max_prompt_length // 2
        assert changes["data.max_response_length"].value == -(-data.max_response_length // LENGTH_FACTOR)
        # Prompts divided by 8, or for the GSM8K tree (16 prompts in mini-batches of 2 trees) by 2.
        factor = 2 if (setting, algorithm) in (("gsm8k-rhomath-1.1b", "spo_tree"), ("gsm8k-rhomath-1.1b", "spo_tree_cutpoint")) \
            else BATCH_FACTOR
        assert changes["data.train_batch_size"].value * factor == data.train_batch_size
        steps_per_iteration = data.train_batch_size // shipped.actor_rollout_ref.actor.ppo_mini_batch_size
        assert (changes["data.train_batch_size"].value // changes["actor_rollout_ref.actor.ppo_mini_batch_size"].value
                == steps_per_iteration)
        assert changes["actor_rollout_ref.model.override_config.attn_implementation"].value == "sdpa"
        assert changes["trainer.device"].value == "cpu" and changes["trainer.n_gpus_per_node"].value == 1


def test_lengths_round_up_and_overrides_are_hydra_syntax():
    assert scaled_length(1900) == 475 and scaled_length(30) == 8 and scaled_length([600, 600]) == [150, 150]
    assert scaled_length(1) == 1
    assert Substitution("a.b", [8, 8], "why").override() == "a.b=[8,8]"
    assert Substitution("a.b", False, "why", new_key=True).override() == "+a.b=false"


def test_a_setting_without_a_rehearsal_is_refused_with_the_rehearsed_ones(tmp_path):
    from recipe.spo.rehearsal.__main__ import main

    assert main(["cpu-tiny", "spo_tree", "--output-dir", str(tmp_path)]) == 2
    assert not any(Path(tmp_path).iterdir())


def test_an_exported_checkpoint_folder_that_holds_files_survives_the_rehearsal(tmp_path):
    """A user who exported the real run's CHECKPOINT_DIR and rehearses first keeps that run's checkpoints:
    the rehearsal refuses the folder in one line, before it builds or starts anything."""
    import os
    import subprocess

    from recipe.spo import REPO

    real_run = tmp_path / "tree-666"
    (real_run / "global_step_950").mkdir(parents=True)
    (real_run / "global_step_950" / "x").write_text("weights")
    (real_run / "latest_checkpointed_iteration.txt").write_text("950")
    environment = {key: value for key, value in os.environ.items() if key not in ("SETTING", "ALGORITHM")}
    result = subprocess.run(["bash", str(REPO / "scripts" / "rehearse.sh"), "math-r1-1.5b", "spo_tree"],
                            env={**environment, "CHECKPOINT_DIR": str(real_run)}, capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"rehearse: CHECKPOINT_DIR={real_run} is not empty, and a rehearsal writes only into a folder of its own: unset "
        "CHECKPOINT_DIR (each rehearsal then makes a new folder under checkpoints/rehearsal/) or name an empty or new folder"]
    assert result.stdout == ""  # nothing was built or started
    assert (real_run / "global_step_950" / "x").read_text() == "weights"
    assert sorted(path.name for path in real_run.iterdir()) == ["global_step_950", "latest_checkpointed_iteration.txt"]
