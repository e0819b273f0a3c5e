#!/usr/bin/env bash
# Writes the SPO datasets (MATH, MATH500, AIME24, GSM8K) as verl parquet files; see --help.
# The code lives in recipe/spo/data/prepare.py, run from this checkout (verl's wheel has top-level `scripts` and
# `recipe` packages of its own, so the checkout goes first on the path).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
if [[ -x "$repo_root/.venv/bin/python" ]]; then
  exec "$repo_root/.venv/bin/python" -m recipe.spo.data.prepare "$@"
fi
exec python3 -m recipe.spo.data.prepare "$@"
