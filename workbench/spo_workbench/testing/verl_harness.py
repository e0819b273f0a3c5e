"""Stand-ins for the GPU parts of verl's pipeline, built from verl's own pieces, for the CPU tests
and the CPU demo: running all sessions of a prompt the way verl's agent-loop worker does, and
building the actor's training batch the way the trainer does (left/right padding converted by verl's
``left_right_2_no_padding``), with log-probs from a transformers model on CPU."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import torch
import verl
from hydra import compose, initialize_config_dir
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.tools.tool_registry import load_all_tools
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.utils.padding import left_right_2_no_padding


VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def compose_ppo_trainer(*overrides: str):
    """verl's own ``ppo_trainer`` configuration with Hydra overrides, as ``main_ppo`` composes it."""
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


def make_agent_loop(loop_class, config, server, tokenizer):
    """An agent-loop object as verl's worker makes one, with the tools of ``rollout.multi_turn``."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    tools = load_all_tools(tool_config_path=multi_turn.get("tool_config_path"),
                           function_tool_path=multi_turn.get("function_tool_path"))
    return loop_class(
        trainer_config=DictConfigWrap(config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(tools),
    )


async def run_sessions(loop_class, config, server, tokenizer, uid: str, raw_prompt: list[dict], *,
                       sampling_params: dict[str, Any], session_ids: bool = True, **row: Any) -> list:
    """All ``rollout.n`` sessions of one prompt, concurrently in one event loop, each a fresh agent-loop
    object, as verl's agent-loop worker runs them (the legacy trainer passes no ``session_id``)."""
    sessions = []
    for session in range(config.actor_rollout_ref.rollout.n):
        kwargs = {"uid": uid, "raw_prompt": raw_prompt, **row}
        if session_ids:
            kwargs["session_id"] = session
        sessions.append(make_agent_loop(loop_class, config, server, tokenizer).run(dict(sampling_params), **kwargs))
    return await asyncio.gather(*sessions)


def actor_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    response_length: int,
    **per_token: torch.Tensor,
) -> TensorDict:
    """The actor's update batch: left-padded prompts, right-padded responses, ``per_token`` fields of
    shape (B, response_length) (``response_mask``, ``old_log_probs``, ``advantages``, ...), converted
    to verl's no-padding layout and given the global batch info verl's engine adds."""
    batch = len(prompts)
    prompt_width = max(len(p) for p in prompts)
    prompt_ids = torch.full((batch, prompt_width), pad_token_id)
    response_ids = torch.full((batch, response_length), pad_token_id)
    attention = torch.zeros(batch, prompt_width + response_length, dtype=torch.long)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        prompt_ids[b, prompt_width - len(prompt) :] = torch.tensor(prompt)
        response_ids[b, : len(response)] = torch.tensor(response)
        attention[b, prompt_width - len(prompt) : prompt_width + len(response)] = 1
    data = TensorDict(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention,
            "position_ids": (torch.cumsum(attention, dim=1) - 1).clamp(min=0),
            **per_token,
        },
        batch_size=[batch],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data, dp_size=1, batch_num_tokens=int(data["response_mask"].sum()), global_batch_size=batch
    )
    return data


def model_log_probs(model, prompts, responses, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-input-token log-probs of the next token under ``log_softmax(logits / temperature)``, as
    verl's actor computes them: a nested tensor (position i scores token i + 1, with grad) and the
    same values padded to the responses (B, max response length)."""
    per_sequence, padded = [], torch.zeros(len(prompts), max(len(r) for r in responses))
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([list(prompt) + list(response)])
        logits = model(input_ids=ids).logits[0] / temperature
        scores = torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        per_sequence.append(torch.cat([scores, scores.new_zeros(1)]))
        padded[b, : len(response)] = scores[len(prompt) - 1 :].detach()
    return torch.nested.as_nested_tensor(per_sequence, layout=torch.jagged), padded


def loss_batch(log_prob: torch.Tensor, prompt_length: int = 2, **per_token: torch.Tensor) -> tuple[TensorDict, dict]:
    """A padded actor batch of constant tokens (``per_token`` holds ``response_mask``, ``old_log_probs``,
    ``advantages``, ...; shape (B, response_length)), converted by verl's ``left_right_2_no_padding``,
    and the model output verl's actor would produce for it: ``log_prob`` (B, response_length) placed
    in the nested per-input-token layout (position i scores token i + 1)."""
    response_mask = per_token["response_mask"]
    batch, response_length = response_mask.shape
    sequence_mask = torch.cat([torch.ones(batch, prompt_length, dtype=torch.long), response_mask], dim=1)
    data = TensorDict(
        {
            "prompts": torch.full((batch, prompt_length), 5),
            "responses": torch.full((batch, response_length), 6),
            "input_ids": torch.full((batch, prompt_length + response_length), 7),
            "attention_mask": sequence_mask,
            "position_ids": torch.cumsum(sequence_mask, dim=1) - 1,
            **per_token,
        },
        batch_size=[batch],
    )
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(response_mask.sum()), global_batch_size=batch)
    per_sequence = []
    for b in range(batch):
        length = prompt_length + int(response_mask[b].sum())
        values = torch.zeros(length)
        values[prompt_length - 1 : length - 1] = log_prob[b, : length - prompt_length]
        per_sequence.append(values)
    return data, {"log_probs": torch.nested.as_nested_tensor(per_sequence, layout=torch.jagged)}
