"""verl's own configuration check (``verl.utils.config.validate_config``), run before Ray, its refusal put on
one line with the keys it is about: verl's messages name its own variables, not the keys a user sets."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from hydra.errors import HydraException
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config

from recipe.spo.checks_before_ray.configuration import MOST_GPUS_LISTED

# verl's own checks (``validate_config`` and its configuration classes, built through OmegaConf and Hydra)
# refuse with assertions and OmegaConf's or Hydra's errors as well as ValueError.
VERL_REFUSALS = (ValueError, AssertionError, TypeError, OmegaConfBaseException, HydraException)
VERL_CHECK = "verl's configuration check (verl.utils.config.validate_config) refused it"
# verl's batch rule on FSDP: every step's rows split evenly over all GPUs.
BATCH_RULE = re.compile(r"real_train_batch_size \((\d+)\) must be divisible by minimal possible batch size \((\d+)\)")



def check_with_verl(config: Any) -> None:
    """verl's check; its refusal raises ``ValueError`` with :func:`verl_refusal`'s line."""
    try:
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except VERL_REFUSALS as error:
        raise ValueError(verl_refusal(error, config)) from error


def verl_refusal(error: BaseException, config) -> str:
    """verl's refusal on one line, with the keys it is about and their values (its messages name its own
    variables, not the keys a user sets)."""
    reason = one_line(error)
    batch = BATCH_RULE.search(reason)
    if batch:
        rows, gpus = int(batch.group(1)), int(batch.group(2))
        trainer, data = config.trainer, config.data
        allowed = [count for count in range(1, MOST_GPUS_LISTED + 1) if rows % count == 0]
        return (f"{VERL_CHECK}: data.train_batch_size={data.train_batch_size} x actor_rollout_ref.rollout.n="
                f"{config.actor_rollout_ref.rollout.n} = {rows} rows a step must divide evenly over the "
                f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} (GPUS_PER_NODE) x trainer.nnodes={trainer.nnodes} "
                f"(NNODES) = {gpus} GPUs; GPU counts up to {MOST_GPUS_LISTED} that divide {rows}: "
                f"{', '.join(map(str, allowed))} (or change data.train_batch_size)")
    named = keys_named_in(reason, config)
    return f"{VERL_CHECK}: {reason}" + (f" (the keys: {', '.join(named)})" if named else "")


def keys_named_in(reason: str, config) -> list[str]:
    """``key=value`` for each configuration key whose last part the message names (verl's messages use
    the field names of its configuration classes), in the sections verl validates."""
    try:
        container = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException:
        return []
    found = []

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif re.search(rf"\b{re.escape(prefix.rsplit('.', 1)[-1])}\b", reason) and "_" in prefix.rsplit(".", 1)[-1]:
            found.append(f"{prefix}={node}")

    # verl prefixes a field of the actor's or the critic's configuration with "actor." or "[critic]": where the
    # message names one of them, the other's field of the same name is not meant.
    sides = {"actor_rollout_ref.actor": "actor", "critic": "critic"}
    named_sides = {side for side in sides.values() if re.search(rf"\b{side}\b", reason)}
    for section in ("data", "trainer", "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"):
        if named_sides and section in sides and sides[section] not in named_sides:
            continue
        node = container
        for part in section.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        walk(node, section)
    return found[:6]


def one_line(error: BaseException) -> str:
    """The reason on one line. A check that fails while OmegaConf resolves an interpolation (the tree's
    rollout.n) or builds a configuration class reaches here wrapped in OmegaConf's or Hydra's error: the
    wrapped error's own message is the reason."""
    while isinstance(error, (OmegaConfBaseException, HydraException)) and isinstance(error.__cause__, (ValueError, AssertionError)):
        error = error.__cause__
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, AssertionError):
        text = text or "an assertion without a message"
    return text
