"""Validation with plain answers when the rollout samples with an SPO agent loop: both trainers wrap
their validation dataloader (:func:`plain_validation`) once verl has built it.

verl validates through the rollout's default agent loop unless a row names one (``agent_name``); an SPO
loop there would sample a whole tree (or run Monte Carlo continuations) per validation answer. The
wrapper names verl's single-turn loop instead, or for multi-turn episodes the episode loop, which plays
one episode a prompt without values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.agent_loops.episode_agent_loop import EPISODE_AGENT_LOOP, plays_episodes

# Validation scores one answer per session: SPO's trees and Monte Carlo continuations are for training.
VALIDATION_AGENT_LOOP = "single_turn_agent"


class PlainValidationBatches:
    """A validation dataloader whose batches name ``agent_loop`` instead of SPO's loops; a row that names
    another loop keeps it. Everything else about the dataloader (length, state) is verl's."""

    def __init__(self, dataloader, agent_loop: str = VALIDATION_AGENT_LOOP):
        self._dataloader = dataloader
        self._agent_loop = agent_loop

    def __iter__(self):
        for batch in self._dataloader:
            rows = len(batch["raw_prompt"])
            named = batch.get("agent_name")
            names = [self._agent_loop if named is None or named[i] in SPO_ALGORITHMS else named[i] for i in range(rows)]
            batch["agent_name"] = np.array(names, dtype=object)
            yield batch

    def __len__(self):
        return len(self._dataloader)

    def __getattr__(self, name):
        return getattr(self._dataloader, name)


def plain_validation(trainer: Any) -> None:
    """Make ``trainer.val_dataloader`` sample plain responses when the rollout uses an SPO loop."""
    if trainer.config.actor_rollout_ref.rollout.agent.default_agent_loop in SPO_ALGORITHMS:
        loop = EPISODE_AGENT_LOOP if plays_episodes(trainer.config) else VALIDATION_AGENT_LOOP
        trainer.val_dataloader = PlainValidationBatches(trainer.val_dataloader, loop)
