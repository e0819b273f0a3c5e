"""Segment Policy Optimization (SPO) for verl, in three layers (docs/LAYOUT.md): ``core`` (SPO itself, no
verl), ``adapters`` (SPO in verl) and ``tools`` (study, report, credit command, benchmarks, CPU settings);
``register`` is verl's plugin entry point."""

__version__ = "0.1.0"
