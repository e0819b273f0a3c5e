"""What a launch needs beside the plugin: the CPU settings' models and data, data preparation for the
cluster settings, a cluster setting's CPU rehearsal, the GPU-environment check and the run summary."""

from pathlib import Path

# The checkout the launch scripts run from (its scripts and logs), where the package is installed editable.
REPO = Path(__file__).resolve().parents[2]
