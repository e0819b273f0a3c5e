#!/usr/bin/env bash
# Runs the whole test suite in .venv (set up by scripts/setup_env.sh). Extra arguments go to pytest.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ ! -x .venv/bin/python ]]; then
  echo "run_tests: .venv is missing; run 'bash scripts/setup_env.sh' first" >&2
  exit 2
fi
# The tests start vLLM engines and Ray; keep them on this machine and quiet.
export VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# The slowest tests at the end (the end-to-end runs print their own table of phases); a later
# --durations among the arguments wins.
.venv/bin/python -m pytest --durations=15 "$@"
status=$?
if [[ $status -eq 5 ]]; then
  echo "run_tests: pytest collected no tests; that is an error here, the suite must run" >&2
fi
exit $status
