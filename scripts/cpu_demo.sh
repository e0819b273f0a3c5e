#!/usr/bin/env bash
# SPO-tree end to end on CPU (tiny local model, real vLLM engine on CPU); needs only .venv.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
export VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec .venv/bin/python -m spo_verl.cpu_demo "$@"
