"""``algorithm.spo.packing.enable`` in verl's trainers: verl's actor/rollout/reference worker
with one more call that switches its actor and reference engines to packed forwards
(:func:`spo_verl.adapters.packing.engine.enable_packed_training`).

Both trainers build the worker from ``ray.remote(ActorRolloutRefWorker)`` in their role mapping;
:func:`use_packed_worker` swaps in this subclass, and the trainer calls
:func:`enable_packed_training_on` once the workers are built (next to the SPO loss).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from spo_verl.core.config import SPOSettings
from spo_verl.adapters.packing.engine import PackedTrainingSettings, enable_packed_training

__all__ = ["SPOActorRolloutRefWorker", "enable_packed_training_on", "packed_training_settings", "use_packed_worker"]


class SPOActorRolloutRefWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spo_enable_packed_training(self, settings: PackedTrainingSettings) -> list[str]:
        """Switch this worker's actor and reference engines to packed forwards; returns their roles.
        Only the actor trains, so only the actor checks against per-row forwards."""
        switched = []
        for role in ("actor", "ref"):
            training_worker = getattr(self, role, None)
            engine = getattr(training_worker, "engine", None)
            if engine is not None:
                enable_packed_training(engine, settings if role == "actor" else replace(settings, check_updates=0))
                switched.append(role)
        return switched


def packed_training_settings(settings: SPOSettings) -> PackedTrainingSettings | None:
    """What the packed engines need from the run's settings; None when packed training is off."""
    if not settings.packing.enable:
        return None
    return PackedTrainingSettings.from_spo(settings)


def use_packed_worker(role_worker_mapping: dict, settings: SPOSettings) -> bool:
    """Swap verl's actor/rollout/reference worker for :class:`SPOActorRolloutRefWorker` in a trainer's
    role mapping when packed training is on; True if it did."""
    if packed_training_settings(settings) is None:
        return False
    swapped = False
    for role, remote_class in list(role_worker_mapping.items()):
        if getattr(remote_class, "__ray_actor_class__", None) is ActorRolloutRefWorker:
            role_worker_mapping[role] = ray.remote(SPOActorRolloutRefWorker)
            swapped = True
    if not swapped:
        raise RuntimeError("algorithm.spo.packing.enable: verl's trainer no longer maps a role to "
                           "engine_workers.ActorRolloutRefWorker; the packed worker cannot be put in its place")
    return True


def enable_packed_training_on(worker_groups: list[Any], settings: SPOSettings) -> list[str]:
    """Call :meth:`SPOActorRolloutRefWorker.spo_enable_packed_training` on each distinct worker group;
    returns the roles switched (rank 0's answer per group)."""
    packed = packed_training_settings(settings)
    if packed is None:
        return []
    switched, seen = [], set()
    for group in worker_groups:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        switched.extend(group.spo_enable_packed_training(packed)[0])
    if "actor" not in switched:
        raise RuntimeError(f"algorithm.spo.packing.enable: no actor engine was switched (got {switched})")
    return switched
