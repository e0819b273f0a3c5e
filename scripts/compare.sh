#!/usr/bin/env bash
# The learning study: SPO-tree, SPO-chain, GRPO and GRPO with the probability mask, several seeds each,
# every (algorithm, seed) its own verl run to the same generated-token budget, resumable, then the
# report (plots, CSV, HTML). The same command on a GPU node runs a cluster setting (--setting).
#   bash scripts/compare.sh --help
#   bash scripts/compare.sh --quick          # the pipeline in minutes on the tiny CPU model
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
# The workbench from this checkout, also where PYTHON is a cluster's interpreter with only the plugin installed.
export PYTHONPATH="$repo_root/workbench${PYTHONPATH:+:$PYTHONPATH}"
default_python=python3
[[ -x "$repo_root/.venv/bin/python" ]] && default_python="$repo_root/.venv/bin/python"
export PYTHON="${PYTHON:-$default_python}"
exec "$PYTHON" -m spo_workbench.study.compare "$@"
