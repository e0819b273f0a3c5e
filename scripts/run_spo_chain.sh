#!/usr/bin/env bash
# SPO-chain int5 on GSM8K with RhoMath-1.1B (the paper's short-CoT setting) on a verl GPU cluster.
# Same overrides as run_spo_tree.sh; the interval and the partition are one Hydra override each, e.g.
#   bash scripts/run_spo_chain.sh algorithm.spo.chain.cutpoint_interval=2
#   bash scripts/run_spo_chain.sh algorithm.spo.chain.partition=fixed_count
ALGORITHM="${ALGORITHM:-spo_chain}" CLUSTER_SETTING="gsm8k-rhomath-1.1b" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/spo_launch.sh" "$@"
