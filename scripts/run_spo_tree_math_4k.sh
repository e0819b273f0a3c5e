#!/usr/bin/env bash
# The MATH setting's 4K-context stage, as the paper trains it after the 2K stage: SPO-tree 6-6-6 from the
# 2K stage's trained model (exported with verl's model merger, docs/CLUSTER.md "Resume and export"),
# with room for 3,950 response tokens. ALGORITHM=grpo for the baseline's own 4K stage.
#   MODEL_PATH=/shared/models/spo-tree-2k bash scripts/run_spo_tree_math_4k.sh
if [[ -z "${MODEL_PATH:-}" ]]; then
  echo "run_spo_tree_math_4k: set MODEL_PATH to the 2K stage's model, exported with verl's model merger (docs/CLUSTER.md)" >&2
  exit 2
fi
ALGORITHM="${ALGORITHM:-spo_tree}" SETTING="math-r1-1.5b" CLUSTER_SETTING="math-r1-1.5b" \
  MAX_RESPONSE_LENGTH="${MAX_RESPONSE_LENGTH:-3950}" \
  EXPERIMENT_NAME="${EXPERIMENT_NAME:-math-r1-1.5b-${ALGORITHM:-spo_tree}-4k}" \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/spo_launch.sh" "$@"
