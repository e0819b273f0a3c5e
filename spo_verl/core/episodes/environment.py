"""The environment of a multi-turn episode: what answers each of the model's turns.

An environment is reset with the prompt's row of data (its ``extra_info``, ``reward_model``, ...), then
stepped with each of the model's turns as text; each step returns the environment's message (the next
user or tool turn), whether the episode is over and, when it is, the episode's reward. ``fork`` returns
an independent copy in the same state: Monte Carlo continuations and tree branches continue a dialogue
from a turn boundary with a fork of the environment as it was there.

Environments are registered by name (``register_environment``), as verl registers agent loops, and
picked by ``algorithm.spo.turns.environment``: a registered name, or ``module:attribute`` of a class or
factory taking no argument.

An environment that fails costs the episode (or continuation, or tree branch) it fails in, not the
batch: a step that raises ends its episode with reward 0 (``episode.play``), and a reset or fork that
raises gives a :class:`FailedEnvironment`, whose first step raises in turn.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from spo_verl.core.config import SPOConfigError


@dataclass(frozen=True)
class EnvironmentReply:
    message: str = ""  # the environment's next turn, shown to the model ("" when done)
    done: bool = False
    reward: float | None = None  # the episode's reward, given with done
    role: str = "user"  # the chat template's role for the message: "user", or "tool" for a tool's result


class Environment(Protocol):
    def reset(self, data: Mapping[str, Any]) -> None: ...

    async def step(self, turn: str) -> EnvironmentReply: ...

    def fork(self) -> "Environment": ...


class CopiedEnvironment:
    """A base whose fork is a deep copy: right for environments that hold their whole state in Python
    objects (not for one that holds a process or a connection)."""

    def fork(self):
        return copy.deepcopy(self)


class EnvironmentFailed(RuntimeError):
    """An environment's reset or fork raised; the episode that needed it ends at its next step."""


class FailedEnvironment:
    """Stands in for an environment whose reset or fork raised: its step raises :class:`EnvironmentFailed`
    naming what failed, so the episode ends as any failing environment's does (reward 0, the error logged)
    after one turn of the model (a response is never empty)."""

    def __init__(self, reason: str):
        self.reason = reason

    def reset(self, data: Mapping[str, Any]) -> None:
        pass

    async def step(self, turn: str) -> EnvironmentReply:
        raise EnvironmentFailed(self.reason)

    def fork(self) -> "FailedEnvironment":
        return self


def _failure(what: str, error: Exception) -> FailedEnvironment:
    return FailedEnvironment(f"{what} raised {type(error).__name__}: {error}")


def reset_environment(factory: Callable[[], Environment], data: Mapping[str, Any]) -> Environment:
    """A new environment reset with the prompt's row, or a :class:`FailedEnvironment` if that raised."""
    try:
        environment = factory()
        environment.reset(data)
    except Exception as error:  # a sandbox that will not start costs its episodes, not the batch
        return _failure("reset", error)
    return environment


def forked(environment: Environment) -> Environment:
    """``environment.fork()``, or a :class:`FailedEnvironment` if that raised."""
    try:
        return environment.fork()
    except Exception as error:
        return _failure("fork", error)


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {}


def register_environment(name: str):
    def register(factory: Callable[[], Environment]):
        if name in ENVIRONMENTS and ENVIRONMENTS[name] is not factory:
            raise ValueError(f"environment {name!r} is already registered ({ENVIRONMENTS[name]!r})")
        ENVIRONMENTS[name] = factory
        return factory

    return register


def environment_factory(name: str, key: str = "algorithm.spo.turns.environment") -> Callable[[], Environment]:
    """The factory ``name`` names, or an error naming ``key`` and the registered environments."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" in name:
        module, _, attribute = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise SPOConfigError(f"{key}={name}: cannot import it ({error})") from error
    raise SPOConfigError(f"{key} must be one of {sorted(ENVIRONMENTS)} or module:attribute, got {name!r}")
