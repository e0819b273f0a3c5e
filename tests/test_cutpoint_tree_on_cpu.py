"""SPO trees that fork at cutpoints (``algorithm.spo.tree.branch_at=cutpoint``): worked examples with
exact values and advantages through the ``spo_tree`` agent loop and verl's advantage step (a scripted
server: the only way to put cutpoints where an example needs them), then the same loop on verl's own
vLLM server."""

import math

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.workers.rollout.replica import TokenOutput

import spo_verl.register  # noqa: F401
from spo_verl.adapters.agent_loops.tree_agent_loop import SPOTreeAgentLoop
from spo_verl.core.algorithms import tree_node_advantages, tree_values
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.core.config import CutpointTreeSettings
from spo_verl.core.rollout.tree_shape import cutpoint_tree_max_leaves, leaf_slots
from spo_workbench.testing.verl_harness import compose_ppo_trainer, make_agent_loop, run_sessions

in_session_loop = pytest.mark.asyncio(loop_scope="session")  # the real server's client lives there

HIGH, LOW = math.log(0.95), math.log(0.5)  # p >= 0.9 and p < 0.9 under the sampler (T = 1, top-p 1)
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def cutpoint_config(model_dir, *, responses=2, width=1, max_forks=1, rounds=1, interval=1, response_length=8, n=None):
    settings = CutpointTreeSettings(responses=responses, width=width, max_forks=max_forks, rounds=rounds, interval=interval)
    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n={n or cutpoint_tree_max_leaves(settings)}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.prompt_length=64",
        "actor_rollout_ref.rollout.agent.default_agent_loop=spo_tree",
        "+algorithm.spo.tree.branch_at=cutpoint",
        f"+algorithm.spo.tree.cutpoint.responses={responses}",
        f"+algorithm.spo.tree.cutpoint.width={width}",
        f"+algorithm.spo.tree.cutpoint.max_forks={max_forks}",
        f"+algorithm.spo.tree.cutpoint.rounds={rounds}",
        f"+algorithm.spo.tree.cutpoint.interval={interval}",
    )


class ScriptedServer:
    """verl's ``generate`` returning scripted paths: ``script[prefix]`` lists the (tokens, log-probs)
    of the requests made from the tree prompt plus ``prefix``, in request order."""

    def __init__(self, script):
        self.script = {prefix: list(paths) for prefix, paths in script.items()}
        self.calls = []
        self.prompt = None

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if self.prompt is None:
            self.prompt = list(prompt_ids)
        assert prompt_ids[: len(self.prompt)] == self.prompt
        prefix = tuple(prompt_ids[len(self.prompt):])
        self.calls.append({"request_id": request_id, "prefix": prefix, "max_tokens": sampling_params["max_tokens"]})
        tokens, log_probs = self.script[prefix].pop(0)
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="completed")


async def sample(config, server, tokenizer, session_ids=True):
    outputs = await run_sessions(SPOTreeAgentLoop, config, server, tokenizer, "cut", [{"role": "user", "content": "Add."}],
                                 sampling_params=SAMPLING, session_ids=session_ids)
    assert all(not server.script[p] for p in server.script), "every scripted path was requested"
    return outputs


def advantages(config, leaves, rewards):
    """verl's advantage step over the leaves: token advantages, per row."""
    width = config.actor_rollout_ref.rollout.response_length
    response_mask = torch.zeros(len(leaves), width)
    token_rewards = torch.zeros(len(leaves), width)
    for row, (out, reward) in enumerate(zip(leaves, rewards)):
        response_mask[row, : len(out.response_ids)] = torch.tensor(out.response_mask, dtype=torch.float)
        token_rewards[row, len(out.response_ids) - 1] = reward
    data = DataProto.from_dict(tensors={"token_level_rewards": token_rewards, "response_mask": response_mask},
                               non_tensors={"uid": np.array(["cut"] * len(leaves), dtype=object)})
    with provide_spo_rows([out.extra_fields["spo"] for out in leaves]) as context:
        result = compute_advantage(data, "spo_tree", config=config.algorithm).batch["advantages"]
        trained = context.trained_mask
    return [result[row, : len(out.response_ids)].tolist() for row, out in enumerate(leaves)], trained


@pytest.mark.asyncio
async def test_worked_example_one_fork_values_and_advantages(tiny_model):
    """Two responses. A = 10 11 12 EOS with p(11) = 0.5 forks at 11; its continuation from "10" is
    15 EOS. B = 13 14 EOS has no cutpoint (one segment). Rewards A 1, continuation 0, B 1.

    Nodes: "10" (A's piece before the fork) with children "11 12 EOS" and "15 EOS"; "13 14 EOS".
    V("11 12 EOS") = 1, V("15 EOS") = 0, V("10") = 0.5, V(B) = 1, V(root) = (0.5 + 1) / 2 = 0.75.
    A("10") = -0.25, A(B) = +0.25, A("11 12 EOS") = +0.5, A("15 EOS") = -0.5; "10" is trained once.
    """
    model_dir, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    server = ScriptedServer({
        (): [([10, 11, 12, eos], [HIGH, LOW, HIGH, HIGH]), ([13, 14, eos], [HIGH] * 3)],
        (10,): [([15, eos], [HIGH, HIGH])],
    })
    config = cutpoint_config(model_dir)
    outputs = await sample(config, server, tokenizer)
    assert config.actor_rollout_ref.rollout.n == 4  # 2 responses x (1 + 1 fork x 1 continuation)
    leaves = [out for out in outputs if out != []]
    assert len(leaves) == 3 and outputs[3] == [], "the slot beyond the tree's 3 leaves returns nothing"
    by_response = {tuple(out.response_ids): out for out in leaves}
    a, c, b = by_response[(10, 11, 12, eos)], by_response[(10, 15, eos)], by_response[(13, 14, eos)]
    spo = {name: out.extra_fields["spo"] for name, out in (("a", a), ("c", c), ("b", b))}
    assert spo["a"]["segment_ends"] == [1, 4] and spo["c"]["segment_ends"] == [1, 3] and spo["b"]["segment_ends"] == [3]
    assert spo["a"]["path"][0] == spo["c"]["path"][0] != spo["b"]["path"][0], "A and its continuation share node '10'"
    assert {call["request_id"] for call in server.calls} == {spo["a"]["tree_id"]}, "one request id per tree"
    # The continuation may use what the response left: 8 - 1 tokens.
    assert [call["max_tokens"] for call in server.calls if call["prefix"] == (10,)] == [7]
    stats = spo["a"]["tree"]
    assert (stats["paths"], stats["forks"], stats["leaves"], stats["nodes"]) == (3, 1, 3, 4)
    assert stats["fork_positions"] == [1 / 4] and stats["generated_tokens"] == 1 + 3 + 2 + 3
    assert stats["independent_sample_tokens"] == 4 + 3 + 3
    rows = [a, c, b]
    token_advantages, trained = advantages(config, rows, [1.0, 0.0, 1.0])
    assert token_advantages[0][1:] == pytest.approx([0.5] * 3)
    assert token_advantages[1][1:] == pytest.approx([-0.5] * 2)
    assert token_advantages[2] == pytest.approx([0.25] * 3)
    # Node "10" belongs to two rows and is trained by one of them, with its own advantage.
    first_tokens = sorted([token_advantages[0][0], token_advantages[1][0]])
    assert first_tokens == pytest.approx([-0.25, 0.0])
    assert int(trained[0, 0]) + int(trained[1, 0]) == 1


@pytest.mark.asyncio
async def test_no_cutpoint_is_one_segment_per_response_like_grpo(tiny_model):
    model_dir, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    server = ScriptedServer({(): [([10, 11, eos], [HIGH] * 3), ([12, eos], [HIGH] * 2)]})
    config = cutpoint_config(model_dir)
    leaves = [out for out in await sample(config, server, tokenizer) if out != []]
    assert [out.extra_fields["spo"]["segment_ends"] for out in leaves] == [[3], [2]]
    assert leaves[0].extra_fields["spo"]["tree"]["forks"] == 0
    token_advantages, _ = advantages(config, leaves, [1.0, 0.0])
    assert token_advantages == [pytest.approx([0.5] * 3), pytest.approx([-0.5] * 2)]  # R - mean(R)


@pytest.mark.asyncio
async def test_a_fork_at_the_first_token_adds_siblings_and_one_at_the_last_splits_off_one_token(tiny_model):
    """A forks at its first token: its continuation is sampled from the prompt alone and becomes A's
    sibling, no empty node. B is cut by the length limit (8 tokens, no EOS) and forks at its last token:
    the continuation gets one token of budget, and its early EOS ends it."""
    model_dir, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    b_tokens = [20, 21, 22, 23, 24, 25, 26, 27]
    server = ScriptedServer({
        (): [([10, 11, eos], [LOW, HIGH, HIGH]), (b_tokens, [HIGH] * 7 + [LOW]), ([12, eos], [HIGH] * 2)],
        tuple(b_tokens[:7]): [([eos], [HIGH])],
    })
    config = cutpoint_config(model_dir)
    leaves = [out for out in await sample(config, server, tokenizer) if out != []]
    by_response = {tuple(out.response_ids): out.extra_fields["spo"] for out in leaves}
    assert set(by_response) == {(10, 11, eos), (12, eos), tuple(b_tokens), (*b_tokens[:7], eos)}
    # The first-token fork: A and its continuation are two one-segment paths under the root.
    assert by_response[(10, 11, eos)]["segment_ends"] == [3] and by_response[(12, eos)]["segment_ends"] == [2]
    # The last-token fork: B's first 7 tokens are one node; 27 and the continuation's EOS its children.
    assert by_response[tuple(b_tokens)]["segment_ends"] == [7, 8]
    assert by_response[(*b_tokens[:7], eos)]["segment_ends"] == [7, 8]
    assert by_response[tuple(b_tokens)]["path"][0] == by_response[(*b_tokens[:7], eos)]["path"][0]
    assert by_response[tuple(b_tokens)]["truncated"] and not by_response[(*b_tokens[:7], eos)]["truncated"]
    assert [call["max_tokens"] for call in server.calls if call["prefix"] == tuple(b_tokens[:7])] == [1]
    assert by_response[(12, eos)]["tree"]["fork_positions"] == [0.0, 7 / 8]
    # Rewards 1, 0 (A, its sibling), B truncated scores 0 whatever its reward, continuation 1:
    # V(B node) = 0.5, V(root) = (1 + 0 + 0.5) / 3 = 0.5.
    rows = [next(out for out in leaves if tuple(out.response_ids) == key)
            for key in ((10, 11, eos), (12, eos), tuple(b_tokens), (*b_tokens[:7], eos))]
    token_advantages, _ = advantages(config, rows, [1.0, 0.0, 1.0, 1.0])
    assert token_advantages[0] == pytest.approx([0.5] * 3) and token_advantages[1] == pytest.approx([-0.5] * 2)
    assert token_advantages[2][7] == pytest.approx(-0.5) and token_advantages[3][7] == pytest.approx(0.5)
    assert sorted([token_advantages[2][0], token_advantages[3][0]]) == pytest.approx([0.0, 0.0])  # A(B node) = 0: dropped


@pytest.mark.asyncio
async def test_a_second_round_forks_the_continuations(tiny_model):
    model_dir, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    server = ScriptedServer({
        (): [([10, 11, eos], [HIGH, LOW, HIGH])],
        (10,): [([12, 13, eos], [HIGH, LOW, HIGH])],
        (10, 12): [([14, eos], [HIGH, LOW])],  # round 2: no further forks, whatever its probabilities
    })
    config = cutpoint_config(model_dir, responses=1, rounds=2)
    assert config.actor_rollout_ref.rollout.n == 3
    leaves = [out for out in await sample(config, server, tokenizer) if out != []]
    by_response = {tuple(out.response_ids): out.extra_fields["spo"] for out in leaves}
    # A: "10" | "11 EOS"; its continuation C from "10": "12" | "13 EOS" (round 1 forks again at 13);
    # C's continuation from "10 12": "14 EOS" (round 2, the last: no fork).
    assert by_response[(10, 11, eos)]["segment_ends"] == [1, 3]
    assert by_response[(10, 12, 13, eos)]["segment_ends"] == [1, 2, 4]
    assert by_response[(10, 12, 14, eos)]["segment_ends"] == [1, 2, 4]
    assert by_response[(10, 12, 13, eos)]["path"][:2] == by_response[(10, 12, 14, eos)]["path"][:2]
    assert by_response[(10, 11, eos)]["tree"]["forks"] == 2


def test_leaf_slots_and_the_configuration_time_bound():
    assert leaf_slots({"branch_at": "cutpoint", "cutpoint": {"responses": 4, "width": 2, "max_forks": 2}}) == 4 * (1 + 4)
    assert leaf_slots({"branch_at": "cutpoint", "cutpoint": {"responses": 2, "width": 1, "max_forks": 2, "rounds": 2}}) == 2 * (1 + 2 + 4)
    assert leaf_slots({"branching": [3, 2]}) == leaf_slots([3, 2]) == 6


def test_too_few_sessions_fail_when_the_agent_loop_is_built(tiny_model):
    model_dir, tokenizer = tiny_model
    config = cutpoint_config(model_dir, n=3)
    with pytest.raises(ValueError, match=r"can sample up to 4 leaves a prompt, more than actor_rollout_ref\.rollout\.n=3"):
        make_agent_loop(SPOTreeAgentLoop, config, None, tokenizer)


@pytest.mark.asyncio
async def test_legacy_sessions_get_a_copy_that_trains_nothing_beyond_the_leaves(tiny_model):
    model_dir, tokenizer = tiny_model
    eos = tokenizer.eos_token_id
    server = ScriptedServer({(): [([10, eos], [HIGH] * 2), ([11, eos], [HIGH] * 2)]})
    config = cutpoint_config(model_dir, n=4)
    config.trainer.use_v1 = False
    outputs = await sample(config, server, tokenizer, session_ids=False)
    assert len(outputs) == 4 and all(out != [] for out in outputs)
    assert [out.extra_fields["spo"]["trains"] for out in outputs] == [True, True, False, False]
    assert all(sum(out.response_mask) == 0 for out in outputs[2:])


@in_session_loop
async def test_cutpoint_tree_on_verls_server(recording_client, tiny_model):
    """verl's real server: every continuation is requested from the prompt plus its path's tokens up
    to the fork, every leaf is its path's pieces as the engine returned them, and verl's advantage
    step takes the leaves."""
    model_dir, tokenizer = tiny_model
    config = cutpoint_config(model_dir, responses=2, width=2, max_forks=2, interval=2, response_length=24)
    calls_before = len(recording_client.calls)
    outputs = await run_sessions(SPOTreeAgentLoop, config, recording_client, tokenizer, "real",
                                 [{"role": "user", "content": "Add 3 and 4."}], sampling_params=SAMPLING)
    calls = recording_client.calls[calls_before:]
    leaves = [out for out in outputs if out != []]
    stats = leaves[0].extra_fields["spo"]["tree"]
    assert len(leaves) == stats["leaves"] == stats["paths"] == 2 + 2 * stats["forks"] <= 10
    assert stats["forks"] >= 1, "the tiny random model has low-probability tokens on nearly every position"
    assert len(calls) == stats["paths"]  # T = 1, top-p 1: the sampler's log-probs decide every cutpoint
    prompt = list(leaves[0].prompt_ids)
    for out in leaves:
        meta = out.extra_fields["spo"]
        assert len(meta["path"]) == len(meta["segment_ends"]) and meta["segment_ends"][-1] == len(out.response_ids)
        # The leaf's own path is one engine reply from the prompt plus the tokens before its fork,
        # ids and log-probs as the engine returned them.
        starts = [0, *meta["segment_ends"][:-1]]
        assert any(call["prompt_ids"] == prompt + out.response_ids[:start] and call["token_ids"] == out.response_ids[start:]
                   and call["log_probs"] == out.response_logprobs[start:] for call in calls for start in starts)
    rewards = [float(i % 2) for i in range(len(leaves))]
    token_advantages, trained = advantages(config, leaves, rewards)
    # Rebuild the tree by hand with the plain reference functions: every node with a non-zero
    # advantage is trained exactly once, by one row, with that advantage on all its tokens.
    parents, lengths, leaf_rewards = {}, {}, {}
    for out, reward in zip(leaves, rewards):
        meta, parent, start = out.extra_fields["spo"], 0, 0
        for node, end in zip(meta["path"], meta["segment_ends"]):
            parents[node], lengths[node] = parent, end - start
            parent, start = node, end
        leaf_rewards[meta["path"][-1]] = 0.0 if meta["truncated"] else reward
    order = [0, *sorted(parents)]
    values = tree_values([order.index(parents[n]) if n else -1 for n in order],
                         {order.index(n): r for n, r in leaf_rewards.items()})
    node_advantages = tree_node_advantages([order.index(parents[n]) if n else -1 for n in order], values)
    expected_trained = sum(lengths[n] for n in parents if node_advantages[order.index(n)] != 0)
    assert int(trained.sum()) == expected_trained
    for row, out in enumerate(leaves):
        meta, start = out.extra_fields["spo"], 0
        for node, end in zip(meta["path"], meta["segment_ends"]):
            if trained[row, start:end].any():
                assert token_advantages[row][start:end] == pytest.approx([node_advantages[order.index(node)]] * (end - start))
            start = end
