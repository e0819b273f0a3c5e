"""The run's SPO settings from the verl configuration a component is handed: the one place the plugin
parses ``algorithm.spo`` at run time.

verl hands each process its configuration, not Python objects. So the trainer (in its Ray actor), each
agent-loop worker and each actor worker read the settings here once, when they are built, and hand the
result to what they run (the trainer to its SPO step, the estimators through the advantage channel, the
sample log and the token budget); the driver's validation reads them here before Ray starts. The policy
loss, which verl calls with the actor's configuration alone, reads its section on each call: parsing
takes well under a millisecond, beside a micro-batch's forward and backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spo_verl.core.config import SPOSettings, parse_spo_settings


def spo_section_settings(section: Mapping | None) -> SPOSettings:
    """``algorithm.spo`` itself (a dict, an OmegaConf node, or None for the paper's defaults), validated."""
    return parse_spo_settings(section)


def spo_settings(algorithm: Any) -> SPOSettings:
    """The ``spo`` settings of verl's ``algorithm`` section (what verl hands an advantage estimator as
    ``config``; a trainer's ``config.algorithm``), or the defaults for None."""
    return spo_section_settings(algorithm.get("spo") if algorithm is not None else None)
