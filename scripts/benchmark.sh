#!/usr/bin/env bash
# Benchmarks printed as tables (advantage maths; tree vs independent rollout on vLLM CPU); needs .venv.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
export VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec .venv/bin/python -m spo_verl.benchmark "$@"
