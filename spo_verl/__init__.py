"""Segment Policy Optimization (SPO) for verl."""

__version__ = "0.1.0"
