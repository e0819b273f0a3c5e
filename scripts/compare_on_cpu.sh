#!/usr/bin/env bash
# SPO-tree, SPO-chain, GRPO and GRPO with the probability mask side by side on the CPU through verl's
# trainer (SmolLM2-135M-Instruct, equal generated-token budgets), then the report (plots, CSV, HTML).
#   bash scripts/compare_on_cpu.sh                 # quick mode
#   bash scripts/compare_on_cpu.sh --mode full     # the run of docs/RESULTS.md
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
default_python=python3
[[ -x "$repo_root/.venv/bin/python" ]] && default_python="$repo_root/.venv/bin/python"
export PYTHON="${PYTHON:-$default_python}"
exec "$PYTHON" -m spo_verl.compare "$@"
