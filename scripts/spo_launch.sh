#!/usr/bin/env bash
# Shared launcher of the run_*.sh scripts: the paper's setting for $SETTING, algorithm bundle
# $ALGORITHM (recipe/spo/config/spo_algorithm/), environment overrides, and any extra arguments
# passed to Hydra (e.g. --cfg job to print the composed configuration and start nothing).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

PYTHON="${PYTHON:-python3}"                       # the Python environment that has verl installed
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
DATA_DIR="${DATA_DIR:-$HOME/data/spo}"            # written by scripts/prepare_data.sh
PROJECT_NAME="${PROJECT_NAME:-spo}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-${SETTING}-${ALGORITHM}}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}"
export TENSORBOARD_DIR="${TENSORBOARD_DIR:-tensorboard_log/${PROJECT_NAME}/${EXPERIMENT_NAME}}"

case "$SETTING" in
  math-r1-1.5b)
    # SPO.md section 5, DeepSeek-R1-Distill-Qwen-1.5B on MATH (2K context stage of the paper).
    MODEL_PATH="${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}"
    TRAIN_FILES="${TRAIN_FILES:-$DATA_DIR/math/train.parquet}"
    VAL_FILES="${VAL_FILES:-[$DATA_DIR/math500/test.parquet,$DATA_DIR/aime24/test.parquet]}"
    setting_args=(
      data.train_batch_size=32                     # prompts per iteration
      data.max_prompt_length=512
      data.max_response_length="${MAX_RESPONSE_LENGTH:-1536}"  # 2K context; 3584 for the 4K stage
      actor_rollout_ref.rollout.temperature=0.6
      actor_rollout_ref.rollout.top_p=1.0
      actor_rollout_ref.rollout.val_kwargs.temperature=0.6
      actor_rollout_ref.rollout.val_kwargs.top_p=1.0
      actor_rollout_ref.rollout.val_kwargs.do_sample=true
      algorithm.spo.tree.branching=[6,6,6]
      algorithm.spo.tree.segment_tokens=[600,600]
      actor_rollout_ref.actor.ppo_mini_batch_size=8  # prompts: 4 optimizer steps per iteration (512/128 in the paper)
      actor_rollout_ref.actor.ppo_epochs=1
    )
    ;;
  gsm8k-rhomath-1.1b)
    # SPO.md section 5, RhoMath-1.1B (SFT) on GSM8K.
    MODEL_PATH="${MODEL_PATH:-realtreetune/rho-1b-sft-GSM8K}"
    TRAIN_FILES="${TRAIN_FILES:-$DATA_DIR/gsm8k/train.parquet}"
    VAL_FILES="${VAL_FILES:-[$DATA_DIR/gsm8k/test.parquet]}"
    setting_args=(
      data.train_batch_size=64
      data.max_prompt_length=1023
      data.max_response_length=1024
      actor_rollout_ref.rollout.temperature=0.6
      actor_rollout_ref.rollout.top_p=0.9
      actor_rollout_ref.rollout.val_kwargs.temperature=0.6
      actor_rollout_ref.rollout.val_kwargs.top_p=0.9
      actor_rollout_ref.rollout.val_kwargs.do_sample=true
      algorithm.spo.chain.cutpoint_interval=5
      algorithm.spo.chain.mc_samples=9
      actor_rollout_ref.actor.ppo_mini_batch_size=8  # 64 sequences of 8 samples: 8 optimizer steps per epoch
      actor_rollout_ref.actor.ppo_epochs=2
    )
    ;;
  *)
    echo "spo_launch: unknown SETTING=$SETTING (allowed: math-r1-1.5b, gsm8k-rhomath-1.1b)" >&2
    exit 2
    ;;
esac

echo "spo: algorithm=$ALGORITHM setting=$SETTING model=$MODEL_PATH nodes=$NNODES gpus/node=$GPUS_PER_NODE"
echo "spo: logs -> console and tensorboard at $TENSORBOARD_DIR; checkpoints -> $CHECKPOINT_DIR"

exec "$PYTHON" -m recipe.spo.main_spo \
  spo_algorithm="$ALGORITHM" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" \
  data.val_files="$VAL_FILES" \
  "${setting_args[@]}" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.03 \
  actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.project_name="$PROJECT_NAME" \
  trainer.experiment_name="$EXPERIMENT_NAME" \
  trainer.default_local_dir="$CHECKPOINT_DIR" \
  'trainer.logger=["console","tensorboard"]' \
  trainer.total_epochs="${TOTAL_EPOCHS:-10}" \
  trainer.save_freq="${SAVE_FREQ:-50}" \
  trainer.test_freq="${TEST_FREQ:-10}" \
  "$@"
