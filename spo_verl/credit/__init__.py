"""Where each estimator puts the blame: for wrong answers whose first wrong step can be placed, how much
of the response's negative advantage falls on that step and after it, and how much on the right steps
before it, for SPO's estimators and GRPO on the same rollouts (``blame``: the measures, framework-free)."""
