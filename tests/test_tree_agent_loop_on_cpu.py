"""The spo_tree agent loop against verl's own vLLM server on CPU (verl's LLMServerClient), then through
verl's advantage step."""

import asyncio
import math
import time

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

import spo_verl.register  # noqa: F401
from spo_verl.adapters.agent_loops.tree_agent_loop import SPOTreeAgentLoop
from spo_verl.adapters.trainer.transfer_queue_batch import episodes_from_extra_fields
from spo_verl.adapters.trainer.step_metrics import batch_metrics
from spo_verl.core.algorithms import tree_node_advantages, tree_values
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.core.rollout.tree import block_aligned_budget, sample_tree
from spo_workbench.testing.verl_harness import compose_ppo_trainer, make_agent_loop, run_sessions

in_session_loop = pytest.mark.asyncio(loop_scope="session")  # the server's client lives there

BRANCHING = [3, 2]
SEGMENT_TOKENS = 20
RESPONSE_LENGTH = 40


def verl_config(model_dir, *extra):
    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n={math.prod(BRANCHING)}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.prompt_length=64",
        "actor_rollout_ref.rollout.agent.default_agent_loop=spo_tree",
        f"+algorithm.spo.tree.branching={BRANCHING}",
        f"+algorithm.spo.tree.segment_tokens={SEGMENT_TOKENS}",
        *extra,
    )


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


async def run_prompt(config, server, tokenizer, uid, text, session_ids=True):
    raw_prompt = [{"role": "user", "content": text}]
    return await run_sessions(SPOTreeAgentLoop, config, server, tokenizer, uid, raw_prompt,
                              sampling_params=SAMPLING, session_ids=session_ids)


@pytest.fixture(scope="module")
def config(tiny_model):
    return verl_config(tiny_model[0])


@in_session_loop
async def test_tree_shape_budgets_prefixes_and_log_probs(config, recording_client, tiny_model):
    tokenizer = tiny_model[1]
    prompts = {f"tree{i}": f"Add {i} and {7 * i}, then explain." for i in range(4)}
    calls_before = len(recording_client.calls)
    results = {uid: await run_prompt(config, recording_client, tokenizer, uid, text) for uid, text in prompts.items()}
    calls = recording_client.calls[calls_before:]
    early_stops, tree_ids = 0, set()
    for uid, outputs in results.items():
        leaves = [out for out in outputs if out != []]
        meta = [out.extra_fields["spo"] for out in leaves]
        stats = meta[0]["tree"]
        tree_id = meta[0]["tree_id"]  # unique per sampled tree: the request id of all its calls
        assert all(m["tree"] == stats for m in meta) and all(m["tree_id"] == tree_id for m in meta)
        assert tree_id not in tree_ids, "each prompt has its own tree"
        tree_ids.add(tree_id)
        assert stats["leaves"] == len(leaves)
        # Shape: 3 root children; a child that did not stop has exactly 2 children.
        first_segments = {m["path"][0] for m in meta}
        assert len(first_segments) == BRANCHING[0]
        for node in first_segments:
            below = [m for m in meta if m["path"][0] == node]
            assert len(below) in (1, BRANCHING[1])
            if len(below) == 1 and len(below[0]["path"]) == 1:
                early_stops += 1
        assert stats["nodes"] == BRANCHING[0] + sum(len(m["path"]) == 2 for m in meta)
        # Empty outputs are exactly the slots that merged into an early-stopped node.
        assert sum(out == [] for out in outputs) == math.prod(BRANCHING) - len(leaves)
        for out, m in zip(leaves, meta):
            ends = m["segment_ends"]
            assert len(out.response_ids) == ends[-1] == len(out.response_logprobs) == len(out.response_mask)
            assert len(out.response_ids) <= RESPONSE_LENGTH
            assert ends[0] <= SEGMENT_TOKENS
            stopped_first = len(m["path"]) == 1
            if stopped_first:
                assert out.response_ids[-1] == tokenizer.eos_token_id or ends[0] < SEGMENT_TOKENS
            else:
                assert ends[0] == SEGMENT_TOKENS and tokenizer.eos_token_id not in out.response_ids[: ends[0]]
            assert all(x <= 0 for x in out.response_logprobs)
        # Every leaf is exactly its path's segments as the engine returned them (ids and log-probs),
        # and each child segment was generated from the prompt plus its parent's tokens.
        by_prompt = {}
        for call in calls:
            by_prompt.setdefault(tuple(call["prompt_ids"]), []).append(call)
        for out, m in zip(leaves, meta):
            position, prefix = 0, list(out.prompt_ids)
            for end in m["segment_ends"]:
                segment = out.response_ids[position:end]
                matching = [c for c in by_prompt[tuple(prefix)] if c["token_ids"] == segment]
                assert matching, f"no generate call produced segment {segment} from its parent's prefix"
                assert matching[0]["log_probs"] == out.response_logprobs[position:end]
                prefix += segment
                position = end
        # Siblings share their parent's prefix: the depth-2 calls of this tree have 3 distinct prompts
        # at most, each the prompt plus one depth-1 segment, issued twice (branching 2).
        depth2 = [c for c in calls if len(c["prompt_ids"]) > len(leaves[0].prompt_ids)
                  and c["prompt_ids"][: len(leaves[0].prompt_ids)] == leaves[0].prompt_ids]
        for group in {tuple(c["prompt_ids"]) for c in depth2}:
            assert sum(tuple(c["prompt_ids"]) == group for c in depth2) == BRANCHING[1]
        tree_request_ids = {c["request_id"] for c in calls if c["prompt_ids"][: len(leaves[0].prompt_ids)] == leaves[0].prompt_ids}
        assert tree_request_ids == {tree_id}, "all calls of one tree use one request id (one server, warm prefix cache)"
    # With ~4% EOS per token and 20-token first segments, some of the 12 first segments stop early.
    assert early_stops >= 1
    assert len(SPOTreeAgentLoop._jobs) == 0, "finished trees are released"


@in_session_loop
async def test_a_childs_subtree_starts_when_its_own_segment_ends(llm_client, tiny_model):
    """verl's real server, with the first root child's reply held back (the only stand-in: a delay):
    the other children's own children are requested, and answered, before that slow child returns."""
    tokenizer = tiny_model[1]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Count to five."}],
                                               add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    events, first_call = [], asyncio.Event()

    async def generate(request_id, *, prompt_ids, sampling_params, **kwargs):
        depth = 1 if len(prompt_ids) == len(prompt_ids_of_root) else 2
        slow = depth == 1 and not first_call.is_set()
        first_call.set()
        events.append(("request", depth, slow, time.monotonic()))
        output = await llm_client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)
        if slow:
            await asyncio.sleep(5.0)
        events.append(("reply", depth, slow, time.monotonic()))
        return output

    prompt_ids_of_root = prompt_ids
    # min_tokens: no first segment stops early, so every root child has children to request.
    params = {**SAMPLING, "min_tokens": 8}
    tree = await sample_tree(generate, "tree-order", prompt_ids, params, branching=[3, 2], segment_budgets=[8],
                             response_length=24, eos_token_ids={tokenizer.eos_token_id})
    slow_reply = next(t for kind, depth, slow, t in events if kind == "reply" and slow)
    grandchildren = [(kind, t) for kind, depth, slow, t in events if depth == 2]
    assert len([kind for kind, _ in grandchildren if kind == "request"]) == 6  # 3 children x 2
    early = [kind for kind, t in grandchildren if t < slow_reply]
    assert early.count("request") == 4 and early.count("reply") == 4, events  # the two fast children's subtrees
    assert len(tree.leaves()) == 6 and all(len(tree.nodes[n].token_ids) == 8 for n in tree.nodes[0].children)
    # Children keep their request order (what verl's session slots count), whatever order they finished in.
    assert tree.nodes[0].children == [1, 2, 3]


def test_block_aligned_budget_ends_a_prefix_one_token_past_a_block():
    assert block_aligned_budget(37, 16, 16) == 28  # 37 + 28 = 65 = 4 * 16 + 1
    assert block_aligned_budget(33, 16, 16) == 16  # already aligned: 49 = 3 * 16 + 1
    assert block_aligned_budget(34, 16, 16) == 31  # never shorter than asked: 65
    assert block_aligned_budget(0, 1, 16) == 1
    assert block_aligned_budget(65, 32, 16) == 32  # a later depth with a whole number of blocks keeps alignment
    for prefix in range(200):
        budget = block_aligned_budget(prefix, 10, 32)
        assert 10 <= budget < 10 + 32 and (prefix + budget) % 32 == 1


@in_session_loop
async def test_aligned_children_recompute_one_prompt_token_on_verls_server(llm_client, tiny_model):
    """verl's real server on vLLM's CPU backend (128-token cache blocks): aligned to the block, every
    child's prefix ends one token past a block and vLLM serves all of it but that token from its prefix
    cache; unaligned, the same tree's children recompute their whole partial block."""
    tokenizer = tiny_model[1]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                               add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    block = 128
    assert len(prompt_ids) + 8 < block

    async def sample(align):
        calls = []

        async def generate(request_id, *, prompt_ids, sampling_params, **kwargs):
            # Every segment gets its full budget (no EOS), so every first-depth node has children.
            params = {**sampling_params, "min_tokens": sampling_params["max_tokens"]}
            output = await llm_client.generate(request_id, prompt_ids=prompt_ids, sampling_params=params, **kwargs)
            calls.append((len(prompt_ids), output.extra_fields["num_cached_tokens"], len(output.token_ids)))
            return output

        await sample_tree(generate, f"aligned-{align}", prompt_ids, dict(SAMPLING), branching=[2, 2], segment_budgets=[8],
                          response_length=160, eos_token_ids={tokenizer.eos_token_id}, align_to_block=align)
        return calls

    aligned = await sample(block)
    first = block_aligned_budget(len(prompt_ids), 8, block)
    assert sorted(c[2] for c in aligned if c[0] == len(prompt_ids)) == [first, first]
    children = [c for c in aligned if c[0] > len(prompt_ids)]
    assert len(children) == 4 and all(length == block + 1 and cached == block for length, cached, _ in children), aligned
    unaligned = [c for c in await sample(None) if c[0] > len(prompt_ids)]
    assert len(unaligned) == 4 and all(length == len(prompt_ids) + 8 and cached == 0 for length, cached, _ in unaligned), unaligned


def reward_of(tokenizer, response_ids):
    """A toy rule-based reward: does the response contain the digit 7?"""
    return float("7" in tokenizer.decode(response_ids))


@in_session_loop
async def test_leaves_through_verls_advantage_step(config, llm_client, tiny_model):
    tokenizer = tiny_model[1]
    prompts = {"adv1": "Say a number with 7 in it.", "adv2": "Count to 9."}
    leaves, uids = [], []
    for uid, text in prompts.items():
        for out in await run_prompt(config, llm_client, tokenizer, uid, text):
            if out != []:
                leaves.append(out)
                uids.append(uid)
    width = RESPONSE_LENGTH
    response_mask = torch.zeros(len(leaves), width)
    token_rewards = torch.zeros(len(leaves), width)
    for row, out in enumerate(leaves):
        response_mask[row, : len(out.response_ids)] = 1
        token_rewards[row, len(out.response_ids) - 1] = reward_of(tokenizer, out.response_ids)
    rows = [out.extra_fields["spo"] for out in leaves]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": token_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    with provide_spo_rows(rows) as context:
        advantages = compute_advantage(data, "spo_tree", config=config.algorithm).batch["advantages"]
    # Rebuild each tree by hand with the plain reference functions and compare per segment.
    for uid in prompts:
        members = [i for i, u in enumerate(uids) if u == uid]
        assert members and len({rows[i]["tree_id"] for i in members}) == 1, "one tree per prompt"
        ids = {0: -1}
        for i in members:
            parent = 0
            for node in rows[i]["path"]:
                ids.setdefault(node, parent)
                parent = node
        order = sorted(ids)
        parents = [order.index(ids[n]) if ids[n] >= 0 else -1 for n in order]
        # A leaf cut by the length limit scores 0 (algorithm.spo.truncated_response_score=zero).
        leaf_rewards = {order.index(rows[i]["path"][-1]): 0.0 if rows[i]["truncated"] else float(token_rewards[i].sum())
                        for i in members}
        values = tree_values(parents, leaf_rewards)
        expected = dict(zip(order, tree_node_advantages(parents, values)))
        trained_once = set()
        for i in members:
            start = 0
            for node, end in zip(rows[i]["path"], rows[i]["segment_ends"]):
                segment = advantages[i, start:end]
                if context.trained_mask[i, start:end].any():
                    assert node not in trained_once, "each segment is trained by one row only"
                    trained_once.add(node)
                    assert segment.tolist() == pytest.approx([expected[node]] * (end - start), abs=1e-6)
                else:
                    assert segment.abs().sum() == 0
                start = end
        assert trained_once == {n for n in order if n != 0 and expected[n] != 0}


@in_session_loop
async def test_legacy_trainer_gets_one_output_per_session(tiny_model, llm_client):
    config = verl_config(tiny_model[0], "trainer.use_v1=false")
    tokenizer = tiny_model[1]
    for attempt in range(6):
        outputs = await run_prompt(config, llm_client, tokenizer, f"legacy{attempt}", "Tell a story.", session_ids=False)
        assert all(out != [] for out in outputs) and len(outputs) == math.prod(BRANCHING)
        copies = [out for out in outputs if not out.extra_fields["spo"]["trains"]]
        assert all(sum(out.response_mask) == 0 for out in copies)
        trained = [out for out in outputs if out.extra_fields["spo"]["trains"]]
        assert len({tuple(out.extra_fields["spo"]["path"]) for out in trained}) == len(trained)
        if copies:
            break
    assert copies, "an early stop in six trees is expected with this model"


def test_tree_must_fit_the_rollout_settings(tiny_model):
    for extra, message in [
        (["actor_rollout_ref.rollout.n=5"], r"rollout\.n must equal the number of leaf slots .* \(6\), got 5"),
        ([f"actor_rollout_ref.rollout.response_length={SEGMENT_TOKENS}"], r"segment_tokens \[20\] use 20 tokens"),
    ]:
        config = verl_config(tiny_model[0], *extra)
        with pytest.raises(ValueError, match=message):
            make_agent_loop(SPOTreeAgentLoop, config, None, tiny_model[1])


@in_session_loop
async def test_a_tree_over_turns_on_verls_server_and_through_verls_advantage_step(tiny_model, llm_client):
    """``branch_at=turn``, 2-2 over a two-operation arithmetic dialogue: two first turns, each answered by
    the environment and continued twice to the episode's end. Each leaf is its dialogue, the reply out of
    the mask; leaves under one first turn share it token for token; the score is the episode's reward;
    through verl's advantage step every turn carries V(node) - V(parent) and the reply nothing."""
    import re

    from spo_verl.adapters.agent_loops.episode_agent_loop import chat_reply_tokens

    model_dir, tokenizer = tiny_model
    length = 48  # as the session's server; a turn of at most 3 tokens, its reply (~41 tokens), a second turn
    config = compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=4",
        f"actor_rollout_ref.rollout.response_length={length}", "actor_rollout_ref.rollout.prompt_length=64",
        "actor_rollout_ref.rollout.agent.default_agent_loop=spo_tree", "+algorithm.spo.tree.branching=[2,2]",
        "+algorithm.spo.tree.branch_at=turn", "+algorithm.spo.turns.environment=arithmetic_dialogue",
        "+algorithm.spo.turns.max_turns=2", "+algorithm.spo.turns.max_turn_tokens=3")
    outputs = await run_sessions(
        SPOTreeAgentLoop, config, llm_client, tokenizer, "turns1", [{"role": "user", "content": "Start with 5. Add 3 to that."}],
        sampling_params=SAMPLING, data_source="toy", extra_info={"start": 5, "operations": ["+3", "-2"], "answer": 6})
    reply = chat_reply_tokens(tokenizer, "Subtract 2 from that.")
    assert all(out != [] for out in outputs)  # no episode ends after one turn: four leaves, one a slot
    rows = [out.extra_fields["spo"] for out in outputs]
    first_turns = {}
    for out, row in zip(outputs, rows):
        first_end, end = row["segment_ends"]
        assert end == len(out.response_ids) and out.response_ids[first_end - len(reply):first_end] == reply
        turn = out.response_mask.index(0)
        assert out.response_mask == [1] * turn + [0] * (first_end - turn) + [1] * (end - first_end)
        assert out.response_logprobs[turn:first_end] == [0.0] * (first_end - turn)
        assert first_turns.setdefault(row["path"][0], out.response_ids[:first_end]) == out.response_ids[:first_end]
        cut = out.response_ids[-1] != tokenizer.eos_token_id and end == length  # the environment never saw it
        numbers = re.findall(r"-?\d+", tokenizer.decode(out.response_ids[first_end:], skip_special_tokens=True))
        assert out.reward_score == (0.0 if cut else float(bool(numbers) and int(numbers[-1]) == 6))
        assert row["truncated"] == cut and out.num_turns == 4
        assert out.extra_fields["reward_extra_info"] == {
            "acc": out.reward_score, "problem": '{"answer": 6, "operations": ["+3", "-2"], "start": 5}'}
        assert out.extra_fields["spo_turns"] == {"turns": 2, "reply_tokens": first_end - turn, "ended_by": "length" if cut else "environment",
                                  "environment_error": None}
    assert len(first_turns) == 2
    # The tree's cost is the model's tokens, each node once: the environment's replies are not generated.
    first_turn_tokens = {row["path"][0]: out.response_mask.index(0) for out, row in zip(outputs, rows)}
    second_turn_tokens = [len(out.response_ids) - row["segment_ends"][0] for out, row in zip(outputs, rows)]
    assert rows[0]["tree"]["generated_tokens"] == sum(first_turn_tokens.values()) + sum(second_turn_tokens)
    assert rows[0]["tree"]["independent_sample_tokens"] == sum(sum(out.response_mask) for out in outputs)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[0.0] * (len(o.response_ids) - 1) + [o.reward_score] + [0.0] * (length - len(o.response_ids))
                                                      for o in outputs]),
                 "response_mask": torch.tensor([o.response_mask + [0] * (length - len(o.response_mask)) for o in outputs],
                                               dtype=torch.float32)},
        non_tensors={"uid": np.array(["turns1"] * 4, dtype=object)})
    with provide_spo_rows(rows) as context:
        advantages = compute_advantage(data, "spo_tree", config=config.algorithm).batch["advantages"]
    rewards = [o.reward_score for o in outputs]
    by_first = {node: [r for r, row in zip(rewards, rows) if row["path"][0] == node] for node in first_turns}
    root = sum(sum(v) / len(v) for v in by_first.values()) / 2
    for i, (out, row) in enumerate(zip(outputs, rows)):
        first_end, end = row["segment_ends"]
        turn = out.response_mask.index(0)
        first = sum(by_first[row["path"][0]]) / 2
        assert advantages[i, turn:first_end].abs().sum() == 0  # the reply
        if context.trained_mask[i, :turn].any():
            assert advantages[i, :turn].tolist() == pytest.approx([first - root] * turn, abs=1e-6)
        assert advantages[i, first_end:end].tolist() == pytest.approx([rewards[i] - first] * (end - first_end), abs=1e-6)
    # The values before each turn: the root's before the first, the first turns' mean before the second.
    metrics = batch_metrics(context, data.batch["response_mask"], episodes_from_extra_fields([o.extra_fields for o in outputs]))
    assert metrics["spo/turns/turns_per_episode"] == 2
    assert metrics["spo/turns/value_before_turn1"] == pytest.approx(root)
    assert metrics["spo/turns/value_before_turn2"] == pytest.approx(sum(sum(v) / 2 for v in by_first.values()) / 2)
    assert "spo/turns/value_before_turn3" not in metrics  # the leaves' values are their rewards
