"""A text scored by the reward function verl uses for a row: ``reward.custom_reward_function`` when set,
else verl's ``default_compute_score`` for the row's ``data_source``. For rewards the agent loops need
before verl's reward step runs (Monte Carlo continuations, the end of a tool episode)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.reward_score import default_compute_score


class RowScorer:
    def __init__(self, config: Any):
        self.score_fn = get_custom_reward_fn(config) or default_compute_score

    async def __call__(self, row: dict[str, Any], text: str) -> float:
        """Score ``text`` as verl's reward manager scores a response: with the row's data_source,
        ground truth and extra_info; a function that returns a dict gives its ``score``."""
        call = functools.partial(
            self.score_fn,
            data_source=row.get("data_source"),
            solution_str=text,
            ground_truth=(row.get("reward_model") or {}).get("ground_truth"),
            extra_info=row.get("extra_info"),
        )
        if inspect.iscoroutinefunction(getattr(self.score_fn, "func", self.score_fn)):
            result = await call()
        else:
            result = await asyncio.get_running_loop().run_in_executor(None, call)
        return float(result["score"] if isinstance(result, dict) else result)
