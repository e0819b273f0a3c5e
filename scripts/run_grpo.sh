#!/usr/bin/env bash
# The GRPO baseline on exactly the settings of run_spo_tree.sh (same overrides, same Hydra arguments).
# ALGORITHM=grpo_prob_mask runs GRPO with SPO's probability mask; ALGORITHM=ppo verl's PPO.
ALGORITHM="${ALGORITHM:-grpo}" CLUSTER_SETTING="math-r1-1.5b" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/spo_launch.sh" "$@"
