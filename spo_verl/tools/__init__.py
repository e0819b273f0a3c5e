"""What is built on the plugin: the study, its report, the credit command, the benchmarks, the CPU
settings and data, the launcher's checks and the test harness."""

from pathlib import Path

# The repository the tools run from (its scripts, logs and git history): the package is installed editable.
REPO = Path(__file__).resolve().parents[2]
