"""SPO over turns: episodes played against an environment (scripted model, the arithmetic dialogue),
each turn a segment whose value is the Monte Carlo mean of continuing the dialogue from its start, and
the per-turn advantages through verl's own advantage step, the environment's tokens out of the loss."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

import spo_verl.register  # noqa: F401
from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.core.config import SPOConfigError
from spo_verl.core.episodes.arithmetic import ArithmeticDialogue
from spo_verl.core.episodes.environment import EnvironmentReply, environment_factory
from spo_verl.core.episodes.episode import (ENDED_BY_ENVIRONMENT, ENVIRONMENT_ERROR, LENGTH_LIMIT, EpisodeRules, play,
                                            turn_value)

EOS = 9
# Token -> text of the scripted model's answers; the environment's reply renders as three fixed tokens.
TEXT = {1: "5 + 3 = 8", 2: "5 + 3 = 9", 3: "It is 8", 4: "8 - 2 = 6", 5: "8 - 2 = 7", 6: "9 - 2 = 7", EOS: ""}
REPLY = [20, 21, 22]
PROMPT = [100, 101]
ROW = {"extra_info": {"start": 5, "operations": ["+3", "-2"], "answer": 6}}
RULES = EpisodeRules(max_turns=4, response_length=32, eos_token_ids={EOS})


class ScriptedModel:
    """Each prefix's answers in turn: at the prompt 8 (right), 9 (wrong), "It is 8" (right, another
    path); after 8 and the reply: 6 (right), 7, 7; after 9: 7; after "It is 8": 6."""

    SCRIPT = {(): [1, 2, 3], (1,): [4, 5, 5], (2,): [6], (3,): [4]}

    def __init__(self):
        self.draws: dict[tuple, int] = {}

    async def __call__(self, request_id, *, prompt_ids, sampling_params):
        answers = tuple(t for t in prompt_ids[len(PROMPT):] if t in TEXT and t != EOS)
        options = self.SCRIPT[answers]
        index = self.draws.get(answers, 0)
        self.draws[answers] = index + 1
        token = options[index % len(options)]
        return SimpleNamespace(token_ids=[token, EOS][: sampling_params["max_tokens"]], log_probs=[-0.5, -0.1],
                               stop_reason="stop", extra_fields={})


def render(reply):
    assert reply == EnvironmentReply("Subtract 2 from that.")
    return list(REPLY)


def decode(token_ids):
    return " ".join(TEXT[t] for t in token_ids)


def environment():
    env = ArithmeticDialogue()
    env.reset(ROW)
    return env


async def _episode_and_values(samples=2):
    model = ScriptedModel()
    episode = await play(model, "r", PROMPT, {}, environment(), render, decode, RULES, keep_boundaries=True)
    values = await asyncio.gather(*(
        turn_value(model, "r", PROMPT, {}, episode.boundary_environments[k], render, decode, RULES,
                   episode.turns[:k], samples) for k in range(len(episode.turns))))
    return episode, values


def test_each_turn_gets_the_value_after_it_minus_the_value_before_and_the_replies_none():
    episode, values = asyncio.run(_episode_and_values())
    assert episode.ended_by == ENDED_BY_ENVIRONMENT and episode.reward == 1.0
    assert episode.response_ids == [1, EOS, *REPLY, 4, EOS]
    assert episode.response_mask == [1, 1, 0, 0, 0, 1, 1]
    assert episode.response_log_probs == [-0.5, -0.1, 0.0, 0.0, 0.0, -0.5, -0.1]
    assert episode.turn_starts == [0, 5]
    # V(prompt): its two continuations start with 9 (then 7: 0) and "It is 8" (then 6: 1), in either order.
    # V(after 8 and the reply): its two continuations answer 7 and 7: 0.
    assert [v.value for v in values] == [0.5, 0.0]
    assert [v.continuation_tokens for v in values] == [8, 4] and [v.truncated for v in values] == [0, 0]

    length = len(episode.response_ids)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.tensor([[0.0] * (length - 1) + [episode.reward]]),
                 "response_mask": torch.tensor([episode.response_mask], dtype=torch.float32)},
        non_tensors={"uid": np.array(["dialogue"], dtype=object)})
    row = {"segment_starts": episode.turn_starts, "boundary_values": [v.value for v in values]}
    with provide_spo_rows([row]):
        out = compute_advantage(data, adv_estimator="spo_chain", config=OmegaConf.create({"spo": {}}))
    # Turn 1: V(after it) - V(prompt) = 0 - 0.5; turn 2: R - V(after turn 1) = 1 - 0; the reply: none.
    assert out.batch["advantages"][0].tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_a_failing_environment_scores_its_episode_zero_and_keeps_the_error():
    class Failing(ArithmeticDialogue):
        async def step(self, turn):
            raise ConnectionError("sandbox unreachable")

    env = Failing()
    env.reset(ROW)
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, env, render, decode, RULES))
    assert (episode.ended_by, episode.reward, episode.error) == (ENVIRONMENT_ERROR, 0.0,
                                                                "ConnectionError: sandbox unreachable")
    assert episode.response_ids == [1, EOS]


def test_an_environment_whose_reset_or_rendering_raises_costs_its_episode_not_the_batch():
    """A reset that raises (a sandbox that will not start) ends the episode at its first step, after one
    turn of the model, so that the row is never empty; a reply the chat template cannot render likewise."""
    from spo_verl.core.episodes.environment import reset_environment

    class WillNotStart(ArithmeticDialogue):
        def reset(self, data):
            raise TimeoutError("sandbox did not start")

    env = reset_environment(WillNotStart, ROW)
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, env, render, decode, RULES))
    assert (episode.ended_by, episode.reward, episode.error) == (
        ENVIRONMENT_ERROR, 0.0, "EnvironmentFailed: reset raised TimeoutError: sandbox did not start")
    assert episode.response_ids == [1, EOS] and episode.response_mask == [1, 1]
    assert isinstance(reset_environment(ArithmeticDialogue, ROW), ArithmeticDialogue)

    def unrenderable(reply):
        raise ValueError("the chat template has no role 'tool'")

    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, environment(), unrenderable, decode, RULES))
    assert (episode.ended_by, episode.error) == (ENVIRONMENT_ERROR, "ValueError: the chat template has no role 'tool'")


class ForksOnce(ArithmeticDialogue):
    """An environment whose first fork works and whose later forks raise (their copies fork fine)."""

    def __init__(self):
        super().__init__()
        self.forks = 0

    def fork(self):
        self.forks += 1
        if self.forks > 1:
            raise OSError("snapshot failed")
        copy = ArithmeticDialogue()
        copy.__dict__.update({k: v for k, v in self.__dict__.items() if k != "forks"})
        return copy


def test_a_fork_that_raises_keeps_the_boundaries_before_it_and_fails_only_the_continuations_that_needed_it():
    """At the second turn's start the fork raises: the episode plays on to its own reward, keeping the
    one boundary it could fork (the prompt), so SPO-chain values that one only; a continuation whose
    fork raised scores 0 with the error, as a step that raised would."""
    env = ForksOnce()
    env.reset(ROW)
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, env, render, decode, RULES, keep_boundaries=True))
    assert episode.ended_by == ENDED_BY_ENVIRONMENT and episode.reward == 1.0 and len(episode.turns) == 2
    assert len(episode.boundary_environments) == 1 and episode.boundary_error == "fork raised OSError: snapshot failed"
    value = asyncio.run(turn_value(ScriptedModel(), "r", PROMPT, {}, env, render, decode, RULES, [], samples=2))
    assert (value.value, value.continuations, value.truncated) == (0.0, 2, 2)


def test_a_tree_child_whose_fork_raises_is_a_failed_leaf_and_its_siblings_play_on():
    """Branching 2 at the root over an environment whose second fork raises: the first child plays its
    episode (8, then 6: reward 1), the second's fork failed, so its one turn ends in the error."""
    from spo_verl.core.rollout.turn_tree import sample_turn_tree

    env = ForksOnce()
    env.reset(ROW)
    tree = asyncio.run(sample_turn_tree(ScriptedModel(), "t", PROMPT, {}, env, render, decode, RULES, [2]))
    assert tree.leaves() == [1, 2]
    assert (tree.nodes[1].reward, tree.nodes[1].ended_by) == (1.0, ENDED_BY_ENVIRONMENT)
    assert (tree.nodes[2].reward, tree.nodes[2].ended_by, tree.nodes[2].error) == (
        0.0, ENVIRONMENT_ERROR, "EnvironmentFailed: fork raised OSError: snapshot failed")
    assert tree.nodes[2].token_ids == [2, EOS]


def test_an_episode_cut_by_the_length_limit_scores_zero():
    rules = EpisodeRules(max_turns=4, response_length=6, eos_token_ids={EOS})  # turn, reply, then 1 token left
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, environment(), render, decode, rules))
    assert episode.ended_by == LENGTH_LIMIT and episode.reward == 0.0
    assert episode.response_ids == [1, EOS, *REPLY, 4] and episode.response_mask == [1, 1, 0, 0, 0, 1]
    # A reply that would leave no room for the next turn is not appended: the response stays in its length.
    rules = EpisodeRules(max_turns=4, response_length=5, eos_token_ids={EOS})
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, environment(), render, decode, rules))
    assert (episode.ended_by, episode.reward, episode.response_ids) == (LENGTH_LIMIT, 0.0, [1, EOS])


def test_a_forked_environment_is_independent_of_its_original():
    env = environment()
    fork = env.fork()
    assert asyncio.run(env.step("8")) == EnvironmentReply("Subtract 2 from that.")
    assert asyncio.run(fork.step("8")) == EnvironmentReply("Subtract 2 from that.")
    assert asyncio.run(env.step("6")) == EnvironmentReply(done=True, reward=1.0)
    assert asyncio.run(fork.step("7")) == EnvironmentReply(done=True, reward=0.0)


def test_an_environment_is_named_by_its_registered_name_or_its_import_path():
    assert environment_factory("arithmetic_dialogue") is ArithmeticDialogue
    assert environment_factory("spo_verl.core.episodes.arithmetic:ArithmeticDialogue") is ArithmeticDialogue
    with pytest.raises(SPOConfigError, match=r"algorithm\.spo\.turns\.environment must be one of "
                                             r"\['arithmetic_dialogue'\] or module:attribute, got 'calculater'"):
        environment_factory("calculater")
    with pytest.raises(SPOConfigError, match="cannot import it"):
        environment_factory("no_such_module:Environment")
    with pytest.raises(ValueError, match="needs extra_info with 'operations' and 'answer'"):
        ArithmeticDialogue().reset({"extra_info": {}})


def test_a_turn_cut_by_max_turn_tokens_goes_to_the_environment_and_the_reply_closes_it():
    rules = EpisodeRules(max_turns=4, response_length=32, eos_token_ids={EOS}, max_turn_tokens=1)
    episode = asyncio.run(play(ScriptedModel(), "r", PROMPT, {}, environment(), render, decode, rules))
    assert episode.ended_by == ENDED_BY_ENVIRONMENT and episode.reward == 1.0  # "8", then "6"
    assert episode.response_ids == [1, EOS, *REPLY, 4] and episode.response_mask == [1, 0, 0, 0, 0, 1]
    assert episode.messages == 4  # the prompt, two turns, one reply


def test_per_turn_metrics_of_a_batch_of_episodes():
    """``spo/turns/*`` from each row's episode as the agent loops hand it on (any algorithm's; a copy
    that trains nothing has none), with SPO-chain's values before each turn where a row has them."""
    from spo_verl.adapters.trainer.transfer_queue_batch import episodes_from_extra_fields
    from spo_verl.adapters.trainer.step_metrics import turn_metrics
    from spo_verl.adapters.agent_loops.sessions import Dialogue, session_output
    from spo_verl.core.metadata import ChainRow, EpisodeStatistics

    played = [EpisodeStatistics(2, 3, "environment"), EpisodeStatistics(1, 0, "error", "ConnectionError: down")]
    outputs = [session_output([0], [1, 2, 9, 9, 9, 3], None, None, {}, [], dialogue=Dialogue([1, 1, 0, 0, 0, 1], 4, 1.0, played[0], "")),
               session_output([0], [1], None, None, {}, [], dialogue=Dialogue([1], 2, 0.0, played[1], "")),
               session_output([0], [1], None, None, {}, [], trains=False, dialogue=Dialogue([1], 2, 0.0, played[1], "")),
               session_output([0], [1], None, None, {}, [])]  # no episode
    episodes = episodes_from_extra_fields([out.extra_fields for out in outputs])
    assert episodes == [*played, None, None]
    counts = {"spo/turns/turns_per_episode": 1.5, "spo/turns/reply_tokens_per_episode": 1.5,
              "spo/turns/ended_by_environment_fraction": 0.5, "spo/turns/environment_errors": 1.0}
    assert turn_metrics(episodes) == counts  # verl's own estimators on spo_episode
    chains = [ChainRow([0, 5], [0.5, 0.0]), ChainRow([0], [0.25], truncated=True), ChainRow([0], [1.0]), None]
    assert turn_metrics(episodes, chains) == {**counts, "spo/turns/value_before_turn1": 0.375,
                                              "spo/turns/value_before_turn2": 0.0}
    assert turn_metrics([None, None]) == {}


def test_verls_padding_copies_of_a_row_count_in_no_chain_or_turn_metric():
    """verl's v1 trainer pads a batch with copies of its first row, extra fields included: the per-row
    metrics (SPO-chain's Monte Carlo cost, which the token budget counts, and the episodes') leave them
    out, exactly as if the batch had not been padded."""
    import torch

    from spo_verl.adapters.trainer.step_metrics import batch_metrics
    from spo_verl.adapters.advantage_channel import SPOBatchContext
    from spo_verl.core.metadata import ChainRow, ChainStatistics, EpisodeStatistics

    first = ChainRow([0, 3], [0.5, 0.0], chain=ChainStatistics(2, 8, 40, 0, 0, False, False))
    second = ChainRow([0], [1.0], chain=ChainStatistics(1, 4, 12, 1, 0, False, False))
    episodes = [EpisodeStatistics(2, 5, "error", "OSError: sandbox down"), EpisodeStatistics(1, 0, "environment")]
    real = batch_metrics(SPOBatchContext([first, second]), torch.ones(2, 6), episodes)
    padded = batch_metrics(SPOBatchContext([first, second, first, first]), torch.ones(4, 6), [*episodes, *episodes[:1] * 2],
                           padding=[False, False, True, True])
    assert padded == real
    assert real["spo/chain/mc_tokens"] == 52 and real["spo/chain/mc_continuations"] == 12
    assert real["spo/turns/environment_errors"] == 1 and real["spo/turns/turns_per_episode"] == 1.5
    assert real["spo/turns/value_before_turn1"] == 0.75 and real["spo/turns/value_before_turn2"] == 0.0


def test_the_dialogue_data_plays_to_its_answer_against_the_environment(tmp_path):
    """The CPU settings' dialogues (recipe.spo.cpu_settings.dialogue): distinct, never below 1, worked
    examples as earlier chat turns, and the right numbers, turn by turn, end the episode with reward 1."""
    import pyarrow.parquet as pq

    from recipe.spo.cpu_settings.dialogue import INSTRUCTION, write_dialogues

    train, held_out = write_dialogues(tmp_path, operations=3, train=30, held_out=10, seed=0, examples=[(3, ["+4", "-2"])])
    rows = pq.read_table(train).to_pylist() + pq.read_table(held_out).to_pylist()
    assert [r["extra_info"]["split"] for r in rows] == ["train"] * 30 + ["test"] * 10
    assert len({(r["extra_info"]["start"], *r["extra_info"]["operations"]) for r in rows}) == 40
    for r in rows:
        assert r["prompt"][:4] == [
            {"role": "user", "content": f"Start with 3. Add 4 to that. {INSTRUCTION}"}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Subtract 2 from that."}, {"role": "assistant", "content": "5"}]
        info = r["extra_info"]
        assert r["prompt"][4]["content"].startswith(f"Start with {info['start']}. ") and len(r["prompt"]) == 5
        env, value = ArithmeticDialogue(), info["start"]
        env.reset(r)
        for operation in info["operations"]:
            value += int(operation)
            assert value >= 1
            reply = asyncio.run(env.step(f"{value}"))
        assert reply == EnvironmentReply(done=True, reward=1.0) and value == info["answer"] == int(r["reward_model"]["ground_truth"])


def test_a_tree_over_turns_branches_between_turns_and_values_each_leaf_by_its_episode():
    """Branching 2-2 over the dialogue: the root's children are first turns (8, right; 9, wrong), each
    followed by the environment's reply; their children play the rest of the episode on their own fork
    of the environment. Leaves 6 (right), 7 under 8 and 7, 7 under 9: V = 1, 0, 0, 0; V(8) = 0.5,
    V(9) = 0, V(prompt) = 0.25; the replies are out of the mask."""
    from spo_verl.core.algorithms import tree_node_advantages, tree_values
    from spo_verl.core.rollout.turn_tree import sample_turn_tree

    tree = asyncio.run(sample_turn_tree(ScriptedModel(), "t", PROMPT, {}, environment(), render, decode, RULES, [2, 2]))
    parents = [node.parent for node in tree.nodes]
    assert parents == [-1, 0, 0, 1, 1, 2, 2] and tree.leaves() == [3, 4, 5, 6]
    assert [tree.nodes[i].token_ids for i in (1, 2)] == [[1, EOS, *REPLY], [2, EOS, *REPLY]]
    assert tree.nodes[1].response_mask == tree.nodes[2].response_mask == [1, 1, 0, 0, 0]
    assert [tree.nodes[i].token_ids for i in (3, 4, 5, 6)] == [[4, EOS], [5, EOS], [6, EOS], [6, EOS]]
    assert [tree.nodes[i].reward for i in (3, 4, 5, 6)] == [1.0, 0.0, 0.0, 0.0]
    assert all(tree.nodes[i].stopped and tree.nodes[i].ended_by == ENDED_BY_ENVIRONMENT for i in (3, 4, 5, 6))
    assert not tree.nodes[1].stopped and tree.nodes[1].reward is None
    assert tree.prefix(3) == ([1, EOS, *REPLY, 4, EOS], [-0.5, -0.1, 0.0, 0.0, 0.0, -0.5, -0.1])
    assert tree.response_mask(3) == [1, 1, 0, 0, 0, 1, 1] and tree.segment_ends(3) == [5, 7]
    values = tree_values(parents, {leaf: tree.nodes[leaf].reward for leaf in tree.leaves()})
    assert values == [0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert tree_node_advantages(parents, values) == [0.0, 0.25, -0.25, 0.5, -0.5, 0.0, 0.0]


def test_a_tree_over_turns_stops_where_the_episode_ends_and_refuses_more_depths_than_turns():
    """Three depths over a two-turn dialogue: the episodes end after the second turn, so the second
    depth's nodes are leaves (the slots below them share them); a failing environment makes a leaf
    with reward 0 and the error; a tree deeper than max_turns is refused."""
    from spo_verl.core.rollout.turn_tree import sample_turn_tree

    tree = asyncio.run(sample_turn_tree(ScriptedModel(), "t", PROMPT, {}, environment(), render, decode, RULES, [2, 2, 2]))
    assert [node.depth for node in tree.nodes] == [0, 1, 1, 2, 2, 2, 2] and tree.leaves() == [3, 4, 5, 6]
    assert tree.slot_leaf(0) == (3, True) and tree.slot_leaf(1) == (3, False)

    class FailsOnTheSecondTurn(ArithmeticDialogue):
        async def step(self, turn):
            if self.answered == 1:
                raise RuntimeError("sandbox gone")
            return await super().step(turn)

    failing = FailsOnTheSecondTurn()
    failing.reset(ROW)
    tree = asyncio.run(sample_turn_tree(ScriptedModel(), "t", PROMPT, {}, failing, render, decode, RULES, [2, 2]))
    assert [(tree.nodes[i].reward, tree.nodes[i].ended_by, tree.nodes[i].error) for i in tree.leaves()] == [
        (0.0, ENVIRONMENT_ERROR, "RuntimeError: sandbox gone")] * 4
    with pytest.raises(ValueError, match=r"a tree of depth 5 branches after more turns than an episode has \(4\)"):
        asyncio.run(sample_turn_tree(ScriptedModel(), "t", PROMPT, {}, environment(), render, decode, RULES, [2] * 5))


def test_dialogues_that_show_their_work_ask_for_it_and_still_end_on_the_answer():
    """``show_work`` (cpu-smollm2's dialogue2): the worked dialogues answer with the sum ("7 - 2 = 5"), the
    opening does not ask for the number alone, and such an answer ends the episode with its result read."""
    from recipe.spo.cpu_settings.dialogue import INSTRUCTION, row

    r = row(20, ["+4", "-6"], 18, "test", 0, examples=[(3, ["+4", "-2"])], show_work=True)
    assert r["prompt"] == [
        {"role": "user", "content": "Start with 3. Add 4 to that."}, {"role": "assistant", "content": "3 + 4 = 7"},
        {"role": "user", "content": "Subtract 2 from that."}, {"role": "assistant", "content": "7 - 2 = 5"},
        {"role": "user", "content": "Start with 20. Add 4 to that."}]
    assert INSTRUCTION not in str(r["prompt"])
    env = ArithmeticDialogue()
    env.reset(r)
    assert asyncio.run(env.step("20 + 4 = 24")) == EnvironmentReply("Subtract 6 from that.")
    assert asyncio.run(env.step("24 - 6 = 18")) == EnvironmentReply(done=True, reward=1.0)


def test_a_row_names_its_problem_the_same_whether_read_from_parquet_or_written():
    """The episode loops name a dialogue in verl's validation dumps by its row's extra_info: the same text
    for the row as written and as verl's dataset hands it back (numpy arrays from parquet), none without."""
    import numpy as np

    from spo_verl.adapters.agent_loops.sessions import row_problem

    written = {"extra_info": {"start": 5, "operations": ["+3", "-2"], "answer": 6, "split": "test"}}
    from_parquet = {"extra_info": {"split": "test", "answer": np.int64(6), "operations": np.array(["+3", "-2"]),
                                   "start": 5}}
    assert row_problem(written) == row_problem(from_parquet) == \
        '{"answer": 6, "operations": ["+3", "-2"], "split": "test", "start": 5}'
    assert row_problem({"extra_info": {}}) == row_problem({}) == ""
