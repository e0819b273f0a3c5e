#!/usr/bin/env bash
# Rehearses a cluster setting through verl's real trainer on this machine's CPU, before a cluster job:
# the setting and algorithm as shipped, changing only what the hardware forces (a tiny model of the
# setting's architecture and prompt format, one CPU device, no flash-attn, vLLM's CPU backend, lengths
# and prompts scaled by one declared factor each; recipe/spo/rehearsal/substitutions.py). It prints
# each substitution with its reason, trains 2 steps with a validation and a checkpoint at step 2, then
# starts again and resumes from that checkpoint for step 3.
#
#   bash scripts/rehearse.sh math-r1-1.5b spo_tree
#   bash scripts/rehearse.sh gsm8k-rhomath-1.1b spo_chain --cfg job   # the configuration it would train
#
# Further arguments go to Hydra. The model and data are built once into SPO_REHEARSAL_CACHE (default
# ~/.cache/spo-verl/rehearsal). Each rehearsal writes its checkpoints into a new folder of its own,
# checkpoints/rehearsal/<setting>-<algorithm>-<time>-XXXXXX; an exported CHECKPOINT_DIR is used only if it is
# empty or does not exist yet (a user may have exported the real run's folder: a rehearsal never deletes
# or writes over what it did not create).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ $# -lt 2 ]]; then
  echo "usage: bash scripts/rehearse.sh SETTING ALGORITHM [hydra overrides]" >&2
  exit 2
fi
export SETTING="$1" ALGORITHM="$2"
shift 2
one_pass=0
for argument in "$@"; do
  case "$argument" in --cfg|--cfg=*|--help|-h|--info|--info=*|--check) one_pass=1 ;; esac
done
# Refused before anything is built, so a wrong folder costs no time.
if [[ -n "${CHECKPOINT_DIR:-}" && -e "$CHECKPOINT_DIR" && ( ! -d "$CHECKPOINT_DIR" || -n "$(ls -A "$CHECKPOINT_DIR")" ) ]]; then
  echo "rehearse: CHECKPOINT_DIR=$CHECKPOINT_DIR is not empty, and a rehearsal writes only into a folder of its own: unset CHECKPOINT_DIR (each rehearsal then makes a new folder under checkpoints/rehearsal/) or name an empty or new folder" >&2
  exit 2
fi
PYTHON="${PYTHON:-$repo_root/.venv/bin/python}"

rehearsal_output="$("$PYTHON" -m recipe.spo.rehearsal "$SETTING" "$ALGORITHM" \
  --output-dir "${SPO_REHEARSAL_CACHE:-$HOME/.cache/spo-verl/rehearsal}")"
eval "$rehearsal_output"
export SPO_REHEARSAL=1 MODEL_PATH="$rehearsal_model" DATA_DIR="$rehearsal_data_dir" PYTHON
export EXPERIMENT_NAME="${EXPERIMENT_NAME:-rehearsal-${SETTING}-${ALGORITHM}}"
folder_name="${SETTING}-${ALGORITHM}-$(date +%Y%m%d-%H%M%S)"
if [[ "$one_pass" == 1 ]]; then  # prints or checks, starts nothing: one pass, and no folder made for it
  export CHECKPOINT_DIR="${CHECKPOINT_DIR:-$repo_root/checkpoints/rehearsal/$folder_name}"
  exec bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" "$@"
fi
if [[ -z "${CHECKPOINT_DIR:-}" ]]; then
  mkdir -p "$repo_root/checkpoints/rehearsal"
  CHECKPOINT_DIR="$(mktemp -d "$repo_root/checkpoints/rehearsal/$folder_name-XXXXXX")"
fi
export CHECKPOINT_DIR

echo "rehearsal: first run: steps 1-2, validation and checkpoint at step 2, into $CHECKPOINT_DIR"
bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" "$@"
# The setting's cosine schedule spans trainer.total_training_steps, so a resume with another step count
# is refused as another run (recipe/spo/resume_guard.py). The rehearsal cut the first start to 2 steps
# only to have a checkpoint to resume in minutes: the second start says so, and the guard still compares
# every other setting and prints what differed.
echo "rehearsal: second run: resumes from the step-2 checkpoint (the setting's trainer.resume_mode) and trains step 3"
bash scripts/spo_launch.sh "${rehearsal_overrides[@]}" trainer.total_training_steps=3 spo_launch.resume_despite_changes=true "$@"
