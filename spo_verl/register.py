"""Registers SPO in verl: estimators ``spo_chain`` and ``spo_tree``, loss ``spo_prob_mask`` and the
``spo_chain``, ``spo_tree`` and ``spo_episode`` (multi-turn episodes for verl's own estimators) agent loops,
the setting's stop strings (``rollout.custom.stop``) on verl's vLLM server, and the OmegaConf resolvers the
recipe's configuration interpolates (``spo_leaf_slots``, ``spo_rows_tokens``).

Loaded in every process that imports verl through the ``verl.plugins`` entry point, or through
``VERL_USE_EXTERNAL_MODULES=spo_verl.register`` / ``actor_rollout_ref.model.external_lib=spo_verl.register``.
Every Ray process imports it, so it imports no trainer code.
"""

from spo_verl.adapters import cpu_platform

if cpu_platform.selected():  # VERL_PLATFORM=spo_cpu: verl on a machine without an accelerator
    cpu_platform.activate()

from spo_verl.adapters import config_resolvers, estimators, policy_loss, stop_strings  # noqa: E402, F401  (registration happens on import)
from spo_verl.adapters.agent_loops import chain_agent_loop, episode_agent_loop, tree_agent_loop  # noqa: E402, F401

stop_strings.install()  # the setting's rollout.custom.stop on verl's vLLM server
config_resolvers.install()  # before anything resolves the recipe's configuration
