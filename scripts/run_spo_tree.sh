#!/usr/bin/env bash
# SPO-tree 6-6-6 on MATH with DeepSeek-R1-Distill-Qwen-1.5B (the paper's long-CoT setting) on a verl
# GPU cluster. Override MODEL_PATH, DATA_DIR (or TRAIN_FILES/VAL_FILES), NNODES, GPUS_PER_NODE,
# EXPERIMENT_NAME, PYTHON; extra arguments go to Hydra (`--cfg job` prints the config, runs nothing).
ALGORITHM="${ALGORITHM:-spo_tree}" CLUSTER_SETTING="math-r1-1.5b" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/spo_launch.sh" "$@"
