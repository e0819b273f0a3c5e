"""Registers SPO's estimators (``spo_chain``, ``spo_tree``) and loss (``spo_prob_mask``) in verl.

Loaded in every process that imports verl through the ``verl.plugins`` entry point, or through
``VERL_USE_EXTERNAL_MODULES=spo_verl.register`` / ``actor_rollout_ref.model.external_lib=spo_verl.register``.
Keep it light: every Ray process imports it.
"""

from spo_verl import estimators, policy_loss  # noqa: F401  (registration happens on import)

ADVANTAGE_ESTIMATORS = ("spo_chain", "spo_tree")
POLICY_LOSSES = (policy_loss.LOSS_NAME,)
