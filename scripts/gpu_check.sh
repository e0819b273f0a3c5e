#!/usr/bin/env bash
# A prepared GPU check (docs/CLUSTER.md): packed against per-row training in bfloat16 on a Qwen2-1.5B-shaped
# model at the cluster settings' lengths, and the SPO maths on the GPU; rows for docs/BENCHMARKS.md from one CSV.
#   bash scripts/gpu_check.sh [--dry-run] [--output DIR] [--whole-tree] [--time-budget SECONDS]
#   bash scripts/gpu_check.sh --record docs/results/gpu_check/gpu_check.csv   # its rows into docs/BENCHMARKS.md
# Needs torch, transformers and omegaconf only (no verl, vLLM or Ray). PYTHON picks the interpreter: default .venv's
# (a CPU build of torch: --dry-run only) when there is one, else python3.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# The workbench from this checkout, also where PYTHON is a cluster's interpreter with only the plugin installed.
export PYTHONPATH="$repo_root/workbench${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec "$PYTHON" -m spo_workbench.benchmarks.gpu_check "$@"
