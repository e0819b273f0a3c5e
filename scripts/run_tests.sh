#!/usr/bin/env bash
# Runs the test suite in .venv (set up by scripts/setup_env.sh).
#
# With no arguments, the whole suite as CI runs it, in two pytest sessions: every test but the
# end-to-end runs on two workers (SPO_TEST_WORKERS; those tests are mostly one process each, so one
# worker leaves a core idle), then, only if all of those passed, the end-to-end runs of verl's whole
# trainer, which run several at once themselves. With arguments, one pytest session with them.
set -uo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ ! -x .venv/bin/python ]]; then
  echo "run_tests: .venv is missing; run 'bash scripts/setup_env.sh' first" >&2
  exit 2
fi
# The set-up leaves compiling to bytecode to Python, and Python keeps what it compiles unless
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines): then each of the suite's processes
# (a trainer run starts eleven) would compile vLLM, verl and transformers again.
unset PYTHONDONTWRITEBYTECODE
# The tests start vLLM engines and Ray; keep them on this machine and quiet.
export VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

# The slowest tests at the end (the end-to-end runs print their own table of phases); a later
# --durations among the arguments wins.
run_pytest() {
  .venv/bin/python -m pytest --durations=15 "$@"
  local status=$?
  if [[ $status -eq 5 ]]; then
    echo "run_tests: pytest collected no tests; that is an error here, the suite must run" >&2
  fi
  return $status
}

if [[ $# -gt 0 ]]; then
  run_pytest "$@"
  exit $?
fi
run_pytest -m "not end_to_end" -n "${SPO_TEST_WORKERS:-2}"
status=$?
if [[ $status -ne 0 ]]; then
  echo "run_tests: the end-to-end runs were not started: the tests before them did not all pass" >&2
  exit $status
fi
run_pytest -m end_to_end
