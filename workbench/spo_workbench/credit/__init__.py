"""The credit command (``python -m spo_workbench.credit``): rollouts through verl's agent loops and
advantage step (``rollouts``), the Monte Carlo value check (``values``) and the page (``figures``); the
measures themselves are the core's (:mod:`spo_verl.core.credit`)."""
