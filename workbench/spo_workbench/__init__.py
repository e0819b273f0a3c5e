"""This repository's workbench on the plugin, not installed with it: the learning studies and their report,
the credit command and the gradient measurement, the benchmarks and the GPU check, and the harness that
runs verl's server, engine and agent loops in one process for the tests, the benchmarks and the measurements."""

from pathlib import Path

# The repository the workbench runs from (its scripts, logs and git history): it is installed editable.
REPO = Path(__file__).resolve().parents[2]
