"""Segment Policy Optimization (SPO) for verl, in two layers (docs/LAYOUT.md): ``core`` (SPO itself, no
verl) and ``adapters`` (SPO in verl); ``register`` is verl's plugin entry point. What a launch needs beside
the plugin (CPU settings, data preparation, the checks before Ray) lives with the recipe, not here."""

__version__ = "0.1.0"
