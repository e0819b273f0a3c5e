#!/usr/bin/env bash
# The GRPO baseline on exactly the settings of run_spo_chain.sh (RhoMath-1.1B on GSM8K, 64 prompts x 8).
# ALGORITHM=grpo_prob_mask runs GRPO with SPO's probability mask; ALGORITHM=ppo verl's PPO.
ALGORITHM="${ALGORITHM:-grpo}" CLUSTER_SETTING="gsm8k-rhomath-1.1b" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/spo_launch.sh" "$@"
