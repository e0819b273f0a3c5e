"""Segment Policy Optimization (SPO) for verl, in three layers (docs/LAYOUT.md): ``core`` (SPO itself, no
verl), ``adapters`` (SPO in verl) and ``tools`` (what a launch needs: CPU settings, data, rehearsal, checks);
``register`` is verl's plugin entry point."""

__version__ = "0.1.0"
