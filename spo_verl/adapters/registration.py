"""SPO's names in verl, installed in the calling process: the estimators ``spo_chain`` and ``spo_tree``, the
loss ``spo_prob_mask``, the agent loops ``spo_chain``, ``spo_tree`` and ``spo_episode`` (multi-turn episodes
for verl's own estimators), the setting's stop strings (``rollout.custom.stop``) on verl's vLLM server, the
OmegaConf resolvers the recipe's configuration interpolates (``spo_leaf_slots``, ``spo_rows_tokens``), and,
with ``VERL_PLATFORM=spo_cpu``, the CPU platform.

verl's plugin entry point (``spo_verl.register``) calls :func:`install` in every process that imports
verl; the TaskRunners call it themselves (``spo_verl.adapters.trainer.runners``), so that the process
Ray starts for them has SPO's names even where verl's plugins are turned off. It imports no trainer code,
since every Ray process runs it.
"""

from __future__ import annotations

_installed = False


def install() -> None:
    """Register everything above in this process (a second call changes nothing)."""
    global _installed
    if _installed:
        return
    from spo_verl.adapters import cpu_platform

    if cpu_platform.selected():  # before verl's modules below read the platform
        cpu_platform.activate()

    # The estimators, the loss and the agent loops register themselves with verl's decorators on import.
    from spo_verl.adapters import config_resolvers, estimators, policy_loss, stop_strings  # noqa: F401
    from spo_verl.adapters.agent_loops import chain_agent_loop, episode_agent_loop, tree_agent_loop  # noqa: F401

    stop_strings.install()
    config_resolvers.install()  # before anything resolves the recipe's configuration
    _installed = True
