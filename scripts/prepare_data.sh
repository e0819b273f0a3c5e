#!/usr/bin/env bash
# Writes the SPO datasets (MATH, MATH500, AIME24, GSM8K) as verl parquet files; see --help.
# The code lives in spo_verl/tools/data/prepare.py (verl's wheel owns the top-level `scripts` package).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
if [[ -x "$repo_root/.venv/bin/python" ]]; then
  exec "$repo_root/.venv/bin/python" -m spo_verl.tools.data.prepare "$@"
fi
exec python3 -m spo_verl.tools.data.prepare "$@"
