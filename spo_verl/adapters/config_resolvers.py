"""The OmegaConf resolvers the recipe's configuration interpolates: ``spo_leaf_slots`` (an SPO tree's
``rollout.n`` from ``algorithm.spo.tree``) and ``spo_rows_tokens`` (a token budget that follows a
setting's prompt and response lengths). ``spo_verl.adapters.registration`` installs them, so they exist
wherever the configuration is resolved: the launch, every Ray process, and any tool or test that imports
the plugin.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from spo_verl.core.rollout.tree_shape import leaf_slots


def rows_tokens(rows: int, prompt_tokens: int, response_tokens: int) -> int:
    """Tokens of ``rows`` rows of the longest prompt and response: a setting's token budgets follow
    its lengths (``${spo_rows_tokens:2,${data.max_prompt_length},${data.max_response_length}}``)."""
    return int(rows) * (int(prompt_tokens) + int(response_tokens))


RESOLVERS = {
    "spo_leaf_slots": leaf_slots,  # actor_rollout_ref.rollout.n: ${spo_leaf_slots:${algorithm.spo.tree}}
    "spo_rows_tokens": rows_tokens,
}


def install() -> None:
    """Register the resolvers that are not registered yet (a second call changes nothing)."""
    for name, resolver in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
