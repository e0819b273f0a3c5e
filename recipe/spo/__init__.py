"""The SPO recipe: its Hydra configuration and entry point, the checks before Ray, and the helpers a launch
runs beside them (the CPU settings' models and data, data preparation, a cluster setting's rehearsal, the
run summary). None of it is installed with the plugin: it runs from this checkout, as verl's recipes do."""

from pathlib import Path

# The checkout the launch scripts run from (its scripts, configuration and logs).
REPO = Path(__file__).resolve().parents[2]
