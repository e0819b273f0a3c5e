"""Rollout logic SPO needs on top of verl's generate interface (tree sampling, MC continuations)."""
