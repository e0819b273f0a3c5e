#!/usr/bin/env bash
# Rehearses a cluster setting through verl's real trainer on this machine's CPU, before a cluster job:
# the setting and algorithm as shipped, changing only what the hardware forces (a tiny model of the
# setting's architecture and prompt format, one CPU device, no flash-attn, vLLM's CPU backend, lengths
# and prompts scaled by one declared factor each; spo_verl/tools/rehearsal/substitutions.py). It prints
# each substitution with its reason, trains 2 steps with a validation and a checkpoint at step 2, then
# starts again and resumes from that checkpoint for step 3.
#
#   bash scripts/rehearse.sh math-r1-1.5b spo_tree
#   bash scripts/rehearse.sh gsm8k-rhomath-1.1b spo_chain --cfg job   # the configuration it would train
#
# Further arguments go to Hydra. The model and data are built once into SPO_REHEARSAL_CACHE (default
# ~/.cache/spo-verl/rehearsal); each rehearsal starts from a fresh checkpoint folder (CHECKPOINT_DIR,
# default checkpoints/rehearsal/<setting>-<algorithm>).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ $# -lt 2 ]]; then
  echo "usage: bash scripts/rehearse.sh SETTING ALGORITHM [hydra overrides]" >&2
  exit 2
fi
export SETTING="$1" ALGORITHM="$2"
shift 2
PYTHON="${PYTHON:-$repo_root/.venv/bin/python}"

rehearsal_output="$("$PYTHON" -m spo_verl.tools.rehearsal "$SETTING" "$ALGORITHM" \
  --output-dir "${SPO_REHEARSAL_CACHE:-$HOME/.cache/spo-verl/rehearsal}")"
eval "$rehearsal_output"
export SPO_REHEARSAL=1 MODEL_PATH="$rehearsal_model" DATA_DIR="$rehearsal_data_dir" PYTHON
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-rehearsal-${SETTING}-${ALGORITHM}}"
export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$repo_root/checkpoints/rehearsal/${SETTING}-${ALGORITHM}}"

for argument in "$@"; do
  case "$argument" in  # prints or checks, starts nothing: one pass
    --cfg|--cfg=*|--help|-h|--info|--info=*|--check) exec bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" "$@" ;;
  esac
done

# The setting resumes from the latest checkpoint in its folder: a rehearsal starts from none.
rm -rf "$CHECKPOINT_DIR"
echo "rehearsal: first run: steps 1-2, validation and checkpoint at step 2"
bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" "$@"
echo "rehearsal: second run: resumes from the step-2 checkpoint (the setting's trainer.resume_mode) and trains step 3"
bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" trainer.total_training_steps=3 "$@"
