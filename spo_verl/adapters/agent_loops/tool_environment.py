"""verl's tools as the environment of a multi-turn episode (``algorithm.spo.turns.environment=verl_tools``).

The tools are the ones verl loads for its own tool agent loop, from ``actor_rollout_ref.rollout.multi_turn``
(``tool_config_path``: ``BaseTool`` subclasses; ``function_tool_path``: ``@function_tool`` functions),
handed to every agent loop by verl's worker; their schemas go into the prompt through the chat template.
Each model turn is read for tool calls by verl's tool parser of ``multi_turn.format`` (e.g. ``hermes``),
and its calls (at most ``multi_turn.max_parallel_calls``) run through verl's own tool call: a ``BaseTool``
gets a fresh instance for the call (created with the row's ``tools_kwargs[name].create_kwargs``, executed,
released), a function tool is called, an unknown tool, bad arguments or a tool's exception become the
result's text, and the text is cut to ``max_tool_response_length`` on ``tool_response_truncate_side``.
The results go back to the model as one message of the ``tool`` role. A turn without a tool call is the
answer: the episode ends, and its reward is the row's reward function on that turn's text.

Because verl makes and releases a tool instance for every call, nothing but the row is kept between
turns, so a fork (a Monte Carlo continuation, a tree's branch) shares the tools. Tools run with
``agent_data=None``: a tool that reads verl's ``AgentData`` is not supported.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import ToolParser

from spo_verl.core.episodes.environment import EnvironmentReply

VERL_TOOLS = "verl_tools"
TOOL_ROLE = "tool"
ScoreText = Callable[[dict[str, Any], str], Awaitable[float]]


class ToolEnvironment:
    def __init__(self, tools: Sequence[Any], multi_turn: Any, tokenizer, score_text: ScoreText):
        if not tools:
            raise ValueError(f"algorithm.spo.turns.environment={VERL_TOOLS} needs tools: set "
                             f"actor_rollout_ref.rollout.multi_turn.tool_config_path or function_tool_path")
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.tool_schema for tool in tools]
        self.parser = ToolParser.get_tool_parser(multi_turn.format, tokenizer)
        self.tokenizer = tokenizer
        self.max_parallel_calls = multi_turn.max_parallel_calls
        # What verl's ToolAgentLoop._call_tool reads of its agent loop.
        self.caller = SimpleNamespace(tools=self.tools, max_tool_response_length=multi_turn.max_tool_response_length,
                                      tool_response_truncate_side=multi_turn.tool_response_truncate_side)
        self.score_text = score_text
        self.row: dict[str, Any] = {}

    def prompt_tools(self) -> list[dict]:
        """The tools' schemas as verl's tool agent loop hands them to the chat template."""
        return [schema.model_dump(exclude_unset=True, exclude_none=True) for schema in self.schemas]

    def reset(self, data: Mapping[str, Any]) -> None:
        self.row = dict(data)

    def fork(self) -> "ToolEnvironment":
        return copy.copy(self)  # shares the tools and the parser; reset() gives a fork its own row

    async def step(self, turn: str) -> EnvironmentReply:
        turn_ids = self.tokenizer.encode(turn, add_special_tokens=False)
        _, calls = await self.parser.extract_tool_calls(turn_ids, self.schemas)
        if not calls:
            return EnvironmentReply(done=True, reward=await self.score_text(self.row, turn))
        tools_kwargs = self.row.get("tools_kwargs") or {}
        results = await asyncio.gather(*(ToolAgentLoop._call_tool(self.caller, call, tools_kwargs, None)
                                         for call in calls[: self.max_parallel_calls]))
        return EnvironmentReply("\n".join(response.text or "" for response, _, _ in results), role=TOOL_ROLE)
