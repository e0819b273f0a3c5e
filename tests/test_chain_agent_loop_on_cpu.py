"""The spo_chain agent loop against verl's own vLLM server on CPU (verl's LLMServerClient), then through
verl's advantage step."""

import math
import re

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

import spo_verl.register  # noqa: F401
from spo_verl.adapters.agent_loops.chain_agent_loop import SPOChainAgentLoop
from spo_verl.core.algorithms import chain_token_advantages, cutpoint_segment_starts
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_workbench.testing.verl_harness import compose_ppo_trainer, make_agent_loop, run_sessions
from spo_verl.adapters.trainer.step_metrics import batch_metrics

in_session_loop = pytest.mark.asyncio(loop_scope="session")  # the server's client lives there
RESPONSE_LENGTH = 48  # as the session server (workbench/spo_workbench/testing/verl_server.py): verl sizes its servers from rollout.response_length
MC_SAMPLES = 3
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
REWARD_SOURCE = '''
def contains_answer(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if ground_truth in solution_str else 0.0}
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD_SOURCE)
    return str(path)


def chain_config(model_dir, reward_file, *extra):
    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.prompt_length=64",
        f"reward.custom_reward_function.path={reward_file}",
        "reward.custom_reward_function.name=contains_answer",
        f"+algorithm.spo.chain.mc_samples={MC_SAMPLES}",
        "+algorithm.spo.chain.cutpoint_interval=4",
        *extra,
    )


async def sample(config, server, tokenizer, uid, text="Say 7 then stop.", ground_truth="7"):
    return await run_sessions(
        SPOChainAgentLoop, config, server, tokenizer, uid, [{"role": "user", "content": text}],
        sampling_params=SAMPLING, data_source="toy", reward_model={"ground_truth": ground_truth}, extra_info={},
    )


@in_session_loop
async def test_boundaries_continuations_and_values(tiny_model, recording_client, reward_file):
    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file)
    before = len(recording_client.calls)
    outputs = await sample(config, recording_client, tokenizer, "chain1")
    calls = recording_client.calls[before:]
    prompt = outputs[0].prompt_ids
    responses = [c for c in calls if c["prompt_ids"] == prompt and c["token_ids"] in [o.response_ids for o in outputs]]
    assert len(outputs) == 4
    distinct_prefixes = set()
    eos = tokenizer.eos_token_id
    for out in outputs:
        meta = out.extra_fields["spo"]
        # top_p 1: the rollout's log-probs are softmax(logits / T); a final EOS is no cutpoint.
        end = len(out.response_ids) - 1 if out.response_ids[-1] == eos else len(out.response_ids)
        probs = [math.exp(lp) for lp in out.response_logprobs[:end]]
        assert meta["segment_starts"] == cutpoint_segment_starts(probs, 0.9, 4)
        assert meta["chain"]["cutpoint_requests"] == 0
        assert len(meta["boundary_values"]) == len(meta["segment_starts"])
        assert all(0.0 <= v <= 1.0 for v in meta["boundary_values"])
        assert all(v * MC_SAMPLES == pytest.approx(round(v * MC_SAMPLES)) for v in meta["boundary_values"])
        distinct_prefixes |= {tuple(out.response_ids[:s]) for s in meta["segment_starts"]}
    # Each continuation's prompt is exactly prompt + a boundary prefix, MC_SAMPLES per distinct prefix.
    continuations = [c for c in calls if c not in responses]
    assert len(continuations) == MC_SAMPLES * len(distinct_prefixes)
    for call in continuations:
        assert call["prompt_ids"][: len(prompt)] == prompt
        prefix = tuple(call["prompt_ids"][len(prompt) :])
        assert prefix in distinct_prefixes
        assert call["sampling_params"]["max_tokens"] == max(RESPONSE_LENGTH - len(prefix), 1)
        assert len(call["token_ids"]) <= RESPONSE_LENGTH - len(prefix)
    total = sum(out.extra_fields["spo"]["chain"]["mc_continuations"] for out in outputs)
    assert total == len(continuations), "shared estimates are counted once"
    assert len(SPOChainAgentLoop._jobs) == 0


@in_session_loop
async def test_no_cutpoint_gives_zero_advantages_and_still_counts(tiny_model, recording_client, reward_file):
    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file, "+algorithm.spo.chain.cutpoint_threshold=1e-12")
    before = len(recording_client.calls)
    outputs = await sample(config, recording_client, tokenizer, "chain2")
    assert len(recording_client.calls) - before == 4, "no boundary, no continuation"
    rows = [out.extra_fields["spo"] for out in outputs]
    assert all(row["segment_starts"] == [] and row["chain"]["no_cutpoint"] for row in rows)
    advantages, metrics = advantages_through_verl(config, outputs, tokenizer)
    assert advantages.abs().sum() == 0
    assert metrics["spo/chain/no_cutpoint_fraction"] == 1.0 and len(advantages) == 4


def advantages_through_verl(config, outputs, tokenizer):
    width = RESPONSE_LENGTH
    response_mask = torch.zeros(len(outputs), width)
    rewards = torch.zeros(len(outputs), width)
    for b, out in enumerate(outputs):
        response_mask[b, : len(out.response_ids)] = 1
        rewards[b, len(out.response_ids) - 1] = float("7" in tokenizer.decode(out.response_ids, skip_special_tokens=True))
    rows = [out.extra_fields["spo"] for out in outputs]
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": response_mask},
                               non_tensors={"uid": np.array(["c"] * len(outputs), dtype=object)})
    with provide_spo_rows(rows) as context:
        advantages = compute_advantage(data, "spo_chain", config=config.algorithm).batch["advantages"]
    return advantages, batch_metrics(context, response_mask)


@in_session_loop
async def test_end_to_end_advantages_match_the_reference(tiny_model, llm_client, reward_file):
    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file, "+algorithm.spo.chain.max_boundaries=2")
    outputs = await sample(config, llm_client, tokenizer, "chain3")
    advantages, metrics = advantages_through_verl(config, outputs, tokenizer)
    for b, out in enumerate(outputs):
        meta = out.extra_fields["spo"]
        assert len(meta["segment_starts"]) <= 2
        # A response cut by the length limit scores 0 (algorithm.spo.truncated_response_score=zero).
        reward = 0.0 if meta["truncated"] else float("7" in tokenizer.decode(out.response_ids, skip_special_tokens=True))
        expected = chain_token_advantages(len(out.response_ids), meta["segment_starts"], meta["boundary_values"], reward)
        assert advantages[b, : len(out.response_ids)].tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["spo/chain/boundaries_per_response"] <= 2
    assert metrics["spo/chain/capped_responses"] == sum(o.extra_fields["spo"]["chain"]["capped"] for o in outputs)


def test_cutpoints_need_temperature_scaled_log_probs(tiny_model, reward_file):
    config = chain_config(tiny_model[0], reward_file, "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs")
    with pytest.raises(ValueError, match="logprobs_mode=processed_logprobs"):
        make_agent_loop(SPOChainAgentLoop, config, None, tiny_model[1])


# The dialogue both episode loops play: start 5, +3 (in the prompt), then -2 from the environment; turns of
# at most 4 tokens.
DIALOGUE_TURNS = ("+algorithm.spo.turns.environment=arithmetic_dialogue", "+algorithm.spo.turns.max_turns=3",
                  "+algorithm.spo.turns.max_turn_tokens=4")


async def play_dialogue(loop_class, config, client, tokenizer, uid):
    """Every session of the dialogue's prompt, and the generate calls they made."""
    before = len(client.calls)
    outputs = await run_sessions(
        loop_class, config, client, tokenizer, uid, [{"role": "user", "content": "Start with 5. Add 3 to that."}],
        sampling_params=SAMPLING, data_source="toy", reward_model={"ground_truth": "6"},
        extra_info={"start": 5, "operations": ["+3", "-2"], "answer": 6})
    return outputs, client.calls[before:]


# The dialogue's row as play_dialogue hands it, as the episode loops name it (sorted JSON of extra_info).
DIALOGUE_ROW = '{"answer": 6, "operations": ["+3", "-2"], "start": 5}'


def dialogue_reward(out, last_turn: int, tokenizer, answer: int) -> float:
    """The arithmetic dialogue's reward of a two-turn episode whose last turn starts at ``last_turn``: the
    last number of that turn against the answer, unless the response length cut the turn (no EOS at the
    limit), when the environment never saw it and the episode scores 0."""
    if out.response_ids[-1] != tokenizer.eos_token_id and len(out.response_ids) == RESPONSE_LENGTH:
        return 0.0
    numbers = re.findall(r"-?\d+", tokenizer.decode(out.response_ids[last_turn:], skip_special_tokens=True))
    return float(bool(numbers) and int(numbers[-1]) == answer)


@in_session_loop
async def test_a_multi_turn_episode_against_the_arithmetic_dialogue(tiny_model, recording_client, reward_file):
    """Each turn a segment: values at each turn start by continuing the dialogue with the environment;
    the environment's replies (the chat template's user turn) in the response, out of the mask."""
    from spo_verl.adapters.agent_loops.episode_agent_loop import chat_reply_tokens

    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file, "+algorithm.spo.chain.partition=turn", *DIALOGUE_TURNS)
    outputs, calls = await play_dialogue(SPOChainAgentLoop, config, recording_client, tokenizer, "dialogue1")
    reply = chat_reply_tokens(tokenizer, "Subtract 2 from that.")
    eos = tokenizer.eos_token_id
    for out in outputs:  # two turns of at most 4 tokens: the environment answers the first, ends after the second
        meta = out.extra_fields["spo"]
        first = out.response_mask.index(0)
        second = meta["segment_starts"][1]
        closing = [] if out.response_ids[first - 1] == eos else [eos]  # a turn cut at 4 tokens gets its EOS
        assert meta["segment_starts"] == [0, second] and first <= 4 and len(out.response_ids) - second <= 4
        assert out.response_ids[first:second] == closing + reply
        assert out.response_mask == [1] * first + [0] * (second - first) + [1] * (len(out.response_ids) - second)
        assert out.response_logprobs[first:second] == [0.0] * (second - first)
        assert out.num_turns == 4  # the prompt, two turns, one reply
        assert out.reward_score == dialogue_reward(out, second, tokenizer, answer=6)
        assert out.extra_fields["reward_extra_info"] == {"acc": out.reward_score, "problem": DIALOGUE_ROW}
        assert all(v * MC_SAMPLES == pytest.approx(round(v * MC_SAMPLES)) for v in meta["boundary_values"])
    # Every generate call is one turn of at most 4 tokens, after the prompt and a dialogue so far.
    assert all(call["sampling_params"]["max_tokens"] <= 4 for call in calls)
    assert all(call["prompt_ids"][: len(outputs[0].prompt_ids)] == outputs[0].prompt_ids for call in calls)
    continuations = sum(out.extra_fields["spo"]["chain"]["mc_continuations"] for out in outputs)
    assert continuations % MC_SAMPLES == 0 and continuations >= MC_SAMPLES  # the prompt's value at least
    assert len(SPOChainAgentLoop._jobs) == 0


@in_session_loop
async def test_the_chains_caps_bound_a_multi_turn_episodes_monte_carlo_work(tiny_model, recording_client, reward_file):
    """``max_boundaries=1`` over turns: only the prompt is valued (once for the prompt's sessions), the
    second turn joins the first turn's segment, and every episode says it was capped."""
    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file, "+algorithm.spo.chain.partition=turn", *DIALOGUE_TURNS,
                          "+algorithm.spo.chain.max_boundaries=1")
    outputs, calls = await play_dialogue(SPOChainAgentLoop, config, recording_client, tokenizer, "dialogue3")
    rows = [out.extra_fields["spo"] for out in outputs]
    assert all(row["segment_starts"] == [0] and len(row["boundary_values"]) == 1 for row in rows)
    assert all(row["chain"]["capped"] and row["chain"]["boundaries"] == 1 for row in rows)
    assert sum(row["chain"]["mc_continuations"] for row in rows) == MC_SAMPLES  # the prompt's value, shared
    # Each continuation plays the two-turn dialogue to its end: at most 2 generate calls each.
    assert len(outputs) * 2 <= len(calls) <= len(outputs) * 2 + MC_SAMPLES * 2
    assert advantages_through_verl(config, outputs, tokenizer)[1]["spo/chain/capped_responses"] == len(outputs)


@in_session_loop
async def test_the_episode_loop_plays_the_same_dialogue_without_values(tiny_model, recording_client, reward_file):
    """``spo_episode`` (verl's own estimators on multi-turn tasks, and every algorithm's validation of one):
    one episode a session, the environment's reply out of the mask, the episode's reward as verl's score,
    no SPO metadata and not one generate call beyond the episode's turns."""
    from spo_verl.adapters.agent_loops.episode_agent_loop import SPOEpisodeAgentLoop, chat_reply_tokens

    model_dir, tokenizer = tiny_model
    config = chain_config(model_dir, reward_file, *DIALOGUE_TURNS,
                          "actor_rollout_ref.rollout.agent.default_agent_loop=spo_episode")
    outputs, calls = await play_dialogue(SPOEpisodeAgentLoop, config, recording_client, tokenizer, "dialogue2")
    reply = chat_reply_tokens(tokenizer, "Subtract 2 from that.")
    for out in outputs:
        first = out.response_mask.index(0)
        second = first + out.response_mask[first:].index(1)
        assert reply == out.response_ids[second - len(reply):second] and out.response_mask[second:] == [1] * (len(out.response_ids) - second)
        assert "spo" not in out.extra_fields and out.num_turns == 4
        # As verl's reward manager records a score; the row names the dialogue in verl's validation dumps.
        assert out.extra_fields["reward_extra_info"] == {"acc": out.reward_score, "problem": DIALOGUE_ROW}
        assert out.reward_score == dialogue_reward(out, second, tokenizer, answer=6)
        # What the spo/turns/* metrics read, for verl's estimators as for SPO's.
        cut = out.response_ids[-1] != tokenizer.eos_token_id and len(out.response_ids) == RESPONSE_LENGTH
        assert out.extra_fields["spo_turns"] == {"turns": 2, "reply_tokens": second - first,
                                                 "ended_by": "length" if cut else "environment", "environment_error": None}
    assert len(calls) == 2 * len(outputs)  # two turns an episode, no continuations
    # Where the blame goes (spo/credit/*) reads these episodes through the tokenizer: every wrong one that
    # played both turns is placed at its first wrong turn; only one cut by the length limit may be not.
    from spo_verl.adapters.trainer.credit_metrics import step_credit_metrics
    from spo_verl.adapters.trainer.batch_view import SampledResponse

    sampled = [SampledResponse(batch_index=i, uid="dialogue2", row=None, prompt_ids=out.prompt_ids,
                               response_ids=out.response_ids, log_probs=torch.tensor(out.response_logprobs),
                               response_mask=torch.tensor(out.response_mask), advantages=torch.zeros(len(out.response_ids)),
                               trained=torch.tensor(out.response_mask).bool(), score=out.reward_score,
                               episode=out.extra_fields["spo_turns"])
               for i, out in enumerate(outputs)]
    metrics = step_credit_metrics(sampled, tokenizer, 0.9)
    wrong = sum(out.reward_score < 1 for out in outputs)
    cut = sum(out.extra_fields["spo_turns"]["ended_by"] == "length" for out in outputs)
    assert metrics["spo/credit/right_answers"] == len(outputs) - wrong
    assert wrong - cut <= metrics["spo/credit/wrong_answers_placed"] <= wrong
    placed = metrics["spo/credit/wrong_answers_placed"]
    shares = [metrics.get(f"spo/turns/first_wrong_turn{k}", 0.0) for k in (1, 2)]
    assert sum(shares) == (pytest.approx(1.0) if placed else 0.0)


def test_the_episode_loop_needs_an_environment(tiny_model, reward_file):
    from spo_verl.adapters.agent_loops.episode_agent_loop import SPOEpisodeAgentLoop

    config = chain_config(tiny_model[0], reward_file, "actor_rollout_ref.rollout.agent.default_agent_loop=spo_episode")
    with pytest.raises(ValueError, match="need algorithm.spo.turns.environment"):
        make_agent_loop(SPOEpisodeAgentLoop, config, None, tiny_model[1])
