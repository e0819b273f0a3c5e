"""verl's tools as a multi-turn episode's environment (``algorithm.spo.turns.environment=verl_tools``): the
model's tool calls read by verl's hermes parser and run by verl's own tool call (a ``BaseTool``'s whole
lifecycle per call, a function tool), the results back as tool turns out of the mask, the answer turn
scored by the row's reward function, and the tools' schemas in the prompt. The model is scripted (no
small model writes tool calls); the tools, parser, chat template and reward function are real."""

import asyncio
from types import SimpleNamespace

import pytest

import spo_verl.register  # noqa: F401
from spo_verl.adapters.agent_loops.episode_agent_loop import SPOEpisodeAgentLoop, chat_reply_tokens
from spo_verl.core.episodes.episode import ENDED_BY_ENVIRONMENT, ENVIRONMENT_ERROR
from recipe.spo.cpu_settings.tiny_model import CHARACTERS, build_tiny_tokenizer
from spo_workbench.testing.verl_harness import compose_ppo_trainer, make_agent_loop

TOOL_MODULE = '''
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

EVENTS = []


class Lookup(BaseTool):
    """A stateful tool: each instance holds the table its row's create_kwargs gave it."""

    tables = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.tables[instance_id] = kwargs["create_kwargs"]["table"]
        EVENTS.append(("create", instance_id))
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        EVENTS.append(("execute", instance_id))
        return ToolResponse(text=str(self.tables[instance_id][parameters["key"]])), 0.0, {}

    async def release(self, instance_id, **kwargs):
        EVENTS.append(("release", instance_id))
        del self.tables[instance_id]
'''
TOOL_CONFIG = """
tools:
  - class_name: spo_test_lookup_tool.Lookup
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: lookup
        description: The value of a key in the row's table.
        parameters: {type: object, properties: {key: {type: string, description: The key.}}, required: [key]}
"""
FUNCTION_TOOLS = '''
from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)
'''
REWARD = '''
def contains_answer(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if ground_truth in solution_str else 0.0}
'''
# ChatML that lists the tools' names in a system turn, as tool-calling chat templates show their schemas.
TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|im_start|>system\nTools:' }}{%- for tool in tools -%}{{- ' ' + tool['function']['name'] }}"
    "{%- endfor -%}{{- '<|im_end|>\n' }}{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' }}{%- endif -%}"
)
# The scripted model's turns, in order: two calls, a call of each tool at once, a call of no tool, the answer.
TURNS = [
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
    '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>',
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "So it is 9.",
]
ROW = {"uid": "p0", "data_source": "toy", "reward_model": {"ground_truth": "9"},
       "tools_kwargs": {"lookup": {"create_kwargs": {"table": {"x": 7}}}}}


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    """Both kinds of tool and a reward file, once: verl registers a function tool's name process-wide."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "spo_test_lookup_tool.py").write_text(TOOL_MODULE)
    (folder / "tools.yaml").write_text(TOOL_CONFIG)
    (folder / "functions.py").write_text(FUNCTION_TOOLS)
    (folder / "reward.py").write_text(REWARD)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder


@pytest.fixture
def tool_run(tool_files, tmp_path):
    """A tokenizer that can write JSON and verl's configuration with the tools."""
    tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer", [*CHARACTERS, "{", "}", '"', "[", "]"])
    config = compose_ppo_trainer(
        f"actor_rollout_ref.model.path={tmp_path / 'tokenizer'}",
        "actor_rollout_ref.rollout.response_length=512",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_files / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tool_files / 'functions.py'}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
        f"reward.custom_reward_function.path={tool_files / 'reward.py'}",
        "reward.custom_reward_function.name=contains_answer",
        "+algorithm.spo.turns.environment=verl_tools",
        "+algorithm.spo.turns.max_turns=6",
    )
    return tokenizer, config


class ScriptedModel:
    """Answers each request with the next of ``turns``, ended by the end-of-turn token."""

    def __init__(self, tokenizer, turns):
        self.replies = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in turns]
        self.prompts = []

    async def __call__(self, request_id, *, prompt_ids, sampling_params):
        self.prompts.append(list(prompt_ids))
        token_ids = self.replies[len(self.prompts) - 1]
        return SimpleNamespace(token_ids=token_ids, log_probs=[-0.5] * len(token_ids), stop_reason="stop",
                               extra_fields={})


def test_tool_calls_run_through_verls_tools_and_come_back_as_tool_turns_out_of_the_mask(tool_run):
    tokenizer, config = tool_run
    loop = make_agent_loop(SPOEpisodeAgentLoop, config, None, tokenizer)
    events = __import__("spo_test_lookup_tool").EVENTS
    events.clear()
    model = ScriptedModel(tokenizer, TURNS)
    episode = asyncio.run(loop.player.play((model, "r", [1, 2], {}), ROW))

    assert episode.ended_by == ENDED_BY_ENVIRONMENT and episode.reward == 1.0  # "9" in the answer turn
    replies = ["5", "7\n2", "Unknown function 'nope'. Available tools: ['lookup', 'add']"]
    assert [turn.reply_ids for turn in episode.turns] == [chat_reply_tokens(tokenizer, text, "tool") for text in replies] + [[]]
    assert chat_reply_tokens(tokenizer, "5", "tool") != chat_reply_tokens(tokenizer, "5")  # the tool's role, not a user's
    assert [turn.token_ids for turn in episode.turns] == model.replies
    # Only the model's turns train; each turn is asked for after the whole dialogue before it.
    assert episode.response_mask == [m for turn in episode.turns for m in [1] * len(turn.token_ids) + [0] * len(turn.reply_ids)]
    assert model.prompts[3] == [1, 2] + episode.response_ids[: -len(episode.turns[3].token_ids)]
    # The stateful tool: one instance per call, made with the row's create_kwargs, released after it.
    assert [event for event, _ in events] == ["create", "execute", "release"] and len({i for _, i in events}) == 1


def test_the_prompt_shows_the_tools_and_a_fork_goes_on_from_the_same_dialogue(tool_run):
    tokenizer, config = tool_run
    tokenizer.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "What is 2 + 3 + 4?"}]

    async def prompt():  # an agent loop keeps the event loop it was made in
        agent_loop = make_agent_loop(SPOEpisodeAgentLoop, config, None, tokenizer)
        return agent_loop, await agent_loop.player.prompt_ids(agent_loop, messages)

    loop, prompt_ids = asyncio.run(prompt())
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nTools: lookup add<|im_end|>\n")

    environment = loop.player.start(ROW)
    fork = environment.fork()
    assert asyncio.run(fork.step("It is 9.")).reward == 1.0 and asyncio.run(environment.step("It is 8.")).reward == 0.0
    assert fork.tools is environment.tools  # a tool instance lives for one call: nothing else to copy


def test_an_answer_the_reward_function_cannot_score_costs_its_episode_only(tool_run):
    """A row without a ground truth: the reward function raises, the episode scores 0 and keeps the error."""
    tokenizer, config = tool_run
    loop = make_agent_loop(SPOEpisodeAgentLoop, config, None, tokenizer)
    episode = asyncio.run(loop.player.play((ScriptedModel(tokenizer, ["It is 9."]), "r", [1, 2], {}), {"uid": "p1"}))
    assert episode.ended_by == ENVIRONMENT_ERROR and episode.reward == 0.0
    assert episode.error.startswith("TypeError") and len(episode.turns) == 1
