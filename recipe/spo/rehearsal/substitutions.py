"""What the rehearsal changes in a cluster setting, and why: the only differences between the configuration
the rehearsal trains with and the one a cluster job would (a test holds the two resolved configurations
against each other). Lengths and batch sizes are scaled by one declared factor each; the tree shape,
segment rules, micro-batch rules, FSDP strategy, log-prob passes, precision, validation sampling and
checkpoint settings are the setting's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

LENGTH_FACTOR = 4  # lengths divided by it (rounded up): a CPU generates and trains ~1/1000 of a GPU's tokens
# Prompts per step and per mini-batch divided by it, or by the largest of its divisors that divides both (a
# GSM8K tree's mini-batch is 2 trees): the optimizer steps per iteration kept.
BATCH_FACTOR = 8
STEPS, RESUMED_STEPS = 2, 3  # trained, validated and checkpointed at step 2; the resumed run trains step 3

# Lengths in tokens: the prompt and response limits and every token budget that the setting writes out.
LENGTH_KEYS = (
    "data.max_prompt_length",
    "data.max_response_length",
    "algorithm.spo.tree.segment_tokens",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "critic.ppo_max_token_len_per_gpu",
)
BATCH_KEYS = ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size")

# Keys that follow a substitution through the setting's or verl's own interpolations, with what they follow.
DERIVED = {
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "distillation.teacher_models.teacher_model.inference.prompt_length": "data.max_prompt_length",
    "distillation.teacher_models.teacher_model.inference.response_length": "data.max_response_length",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "the prompt and response lengths (spo_rows_tokens)",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.actor.policy_loss.spo.tree.segment_tokens": "algorithm.spo.tree.segment_tokens",
    "actor_rollout_ref.rollout.n_gpus_per_node": "trainer.n_gpus_per_node",
    "actor_rollout_ref.rollout.prometheus.served_model_name": "actor_rollout_ref.model.path",
    "critic.model.path": "actor_rollout_ref.model.path",
    "critic.model.tokenizer_path": "actor_rollout_ref.model.path",
    "data.train_files": "DATA_DIR: the rehearsal's problems, written by scripts/prepare_data.sh",
    "data.val_files": "DATA_DIR: the rehearsal's problems, written by scripts/prepare_data.sh",
}


@dataclass(frozen=True)
class Substitution:
    key: str
    value: Any
    reason: str
    new_key: bool = False  # absent from the setting's configuration: Hydra adds it with "+"

    def override(self) -> str:
        value = self.value
        text = (str(value).lower() if isinstance(value, bool) else
                "[" + ",".join(str(item) for item in value) + "]" if isinstance(value, (list, tuple)) else str(value))
        return f"{'+' if self.new_key else ''}{self.key}={text}"


def scaled_length(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [scaled_length(item) for item in value]
    return max(1, math.ceil(value / LENGTH_FACTOR))


def is_interpolation(config: Any, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    return OmegaConf.is_interpolation(OmegaConf.select(config, parent) if parent else config, name)


def batch_factor(shipped: Any) -> int:
    """What the rehearsal divides the prompts of a step and of a mini-batch by: :data:`BATCH_FACTOR`, or its
    largest divisor that divides both."""
    return math.gcd(BATCH_FACTOR, *(OmegaConf.select(shipped, key) for key in BATCH_KEYS))


def substitutions(shipped: Any, model: str, longest_prompt: int = 0) -> list[Substitution]:
    """The changes to ``shipped`` (the setting and algorithm as composed, unresolved) for this machine.
    ``longest_prompt``: the rehearsal's longest rendered prompt in its own tokenizer's tokens; the prompt
    limit is not scaled below it, since the setting's limit filters prompts by the real model's count."""
    found: list[Substitution] = []

    def change(key: str, value: Any, reason: str) -> None:
        current = OmegaConf.select(shipped, key, default=None, throw_on_missing=False)
        present = OmegaConf.select(shipped, key, default="<absent>") != "<absent>"
        if not present or current != value:
            found.append(Substitution(key, value, reason, new_key=not present))

    change("actor_rollout_ref.model.path", model, "a tiny random model of the setting's architecture, its "
           "tokenizer trained here with the setting's special tokens: no model hub here")
    change("trainer.device", "cpu", "no GPU: verl's trainer on the CPU platform (VERL_PLATFORM=spo_cpu)")
    change("trainer.n_gpus_per_node", 1, "one CPU device instead of a node's GPUs")
    change("ray_kwargs.ray_init.num_gpus", 1, "one logical GPU: verl's resource pools ask Ray for GPUs")
    change("ray_kwargs.ray_init.num_cpus", 16, "logical CPUs for verl's many small actors on a 2-core machine")
    change("ray_kwargs.ray_init.include_dashboard", False, "no dashboard process on a 2-core machine")
    change("actor_rollout_ref.model.use_remove_padding", False, "rows without padding need flash-attn, a CUDA build")
    change("actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
           "flash-attn is a CUDA build; sdpa is right only on padded rows")
    for key, value, reason in (
        ("enforce_eager", True, "no CUDA graphs on vLLM's CPU backend"),
        ("gpu_memory_utilization", 0.2, "on vLLM's CPU backend the share of the machine's memory for the KV cache"),
        ("enable_sleep_mode", False, "sleep mode needs CUDA's memory pool"),
        ("free_cache_engine", False, "sleep mode needs CUDA's memory pool"),
    ):
        change(f"actor_rollout_ref.rollout.{key}", value, reason)
    for key, value in (("actor_rollout_ref.rollout.agent.num_workers", 1), ("reward.num_workers", 1),
                       ("transfer_queue.backend.SimpleStorage.num_data_storage_units", 1),
                       ("data.dataloader_num_workers", 0)):
        change(key, value, "one process where a cluster node runs several: 2 cores, 24 GiB")
    for key in LENGTH_KEYS:  # those the setting writes out; an interpolation follows what it reads
        value = OmegaConf.select(shipped, key, default=None)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if value is None or is_interpolation(shipped, key):
            continue
        if key == "data.max_prompt_length" and scaled_length(value) < longest_prompt:
            change(key, longest_prompt, f"lengths divided by {LENGTH_FACTOR}, but not below the rehearsal's longest "
                   f"prompt ({longest_prompt} tokens): the setting's limit filters by the real model's tokens")
        else:
            change(key, scaled_length(value), f"lengths divided by {LENGTH_FACTOR}")
    factor = batch_factor(shipped)
    for key in BATCH_KEYS:
        change(key, OmegaConf.select(shipped, key) // factor, f"prompts divided by {factor}")
    change("trainer.total_training_steps", STEPS, f"{STEPS} steps (the resumed run: {RESUMED_STEPS})")
    change("trainer.save_freq", STEPS, f"a checkpoint at step {STEPS}, resumed from")
    change("trainer.test_freq", STEPS, f"a validation at step {STEPS}")
    return found
