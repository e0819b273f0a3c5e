"""The credit measures (spo_verl.credit.blame) with exact numbers on hand-built advantages: an estimator
that localises an error perfectly, GRPO's uniform advantage, the probability mask, and the net advantage
of identical tokens in the same context; and the rollouts they read, through verl's agent loop and
advantage step on verl's server."""

import gzip
import math

import pytest

from spo_verl.credit.blame import Blame, Response, blame, bootstrap, negative_position, net_advantages, summarise


def response(uid, rid, reward, tokens, advantages, in_loss=None, trained=(), first_error=None):
    return Response(uid, rid, reward, tuple(tokens), tuple(advantages),
                    tuple(in_loss if in_loss is not None else [True] * len(tokens)), tuple(trained), first_error)


def test_an_estimator_that_localises_perfectly_puts_all_blame_on_the_error():
    assert blame([0, 0, 0, 0, -1, -1], first_error=4) == Blame(1.0, 0.0, False)


def test_grpo_blames_every_token_alike():
    # One number for the response: the blame on the error is the share of tokens from the error on.
    assert blame([-0.5] * 10, first_error=4) == Blame(pytest.approx(0.6), -0.5, True)


def test_blame_that_leaks_onto_the_right_steps():
    # SPO-tree with a segment cut inside a step: the right tokens before the wrong number share its -0.25.
    measures = blame([0.25, 0.25, -0.25, -0.25, -0.5, -0.5], first_error=3)
    assert measures.on_error == pytest.approx(1.25 / 1.5)
    assert measures.right_steps_mean == pytest.approx(0.25 / 3) and measures.right_steps_negative is False


def test_only_the_tokens_in_the_loss_count_in_that_view():
    advantages = [-0.4, -0.4, -0.4, -0.4]
    assert blame(advantages, 2, counted=[False, True, True, False]) == Blame(0.5, -0.4, True)
    # No negative mass among the counted tokens: nothing to share out.
    assert blame([0.3, -0.2], 1, counted=[True, False]) == Blame(None, 0.3, False)
    # An error at the first token has no right steps before it.
    assert blame([-1.0, -1.0], 0) == Blame(1.0, None, None)


def test_the_net_advantage_adds_every_trained_instance_of_a_token_in_its_context():
    group = [
        # A tree's two leaves under one node: the node's tokens 1, 2 are trained once, by the first row.
        response("p", "a", 1.0, [1, 2, 3], [0.1, 0.1, 0.5]),
        response("p", "b", 0.0, [1, 2, 4], [0.1, 0.1, -0.5], trained=[False, False, True]),
        # Two sibling nodes that wrote the same right text "1 5" and got +0.25 and -0.25: they cancel.
        response("p", "c", 1.0, [1, 5, 6], [0.25, 0.25, 0.5]),
        response("p", "d", 0.0, [1, 5, 7], [-0.25, -0.25, -0.5]),
    ]
    net = net_advantages(group)
    assert net["a"] == pytest.approx([0.1 + 0.25 - 0.25, 0.1, 0.5])  # token 1 is the same first token in all four
    assert net["b"] == pytest.approx([0.1, 0.1, -0.5])
    assert net["c"] == pytest.approx([0.1, 0.0, 0.5]) and net["d"] == pytest.approx([0.1, 0.0, -0.5])
    # Identical GRPO answers are two instances: their advantages add.
    twins = [response("q", "x", 0.0, [8, 9], [-0.5, -0.5]), response("q", "y", 0.0, [8, 9], [-0.5, -0.5])]
    assert net_advantages(twins) == {"x": [-1.0, -1.0], "y": [-1.0, -1.0]}


def test_where_a_right_answers_negative_mass_sits():
    assert negative_position([0, -1, 0, -1]) == pytest.approx(2 / 3)
    assert negative_position([-1, 0, 0, 0]) == 0.0 and negative_position([0.5, 0.5]) is None


def test_a_summary_counts_each_kind_of_response_and_averages_the_placed_ones():
    group = [
        response("p", "a", 0.0, [1, 2, 3, 4], [0, 0, -1, -1], first_error=2),  # perfectly placed
        response("p", "b", 0.0, [1, 2, 5, 6], [-0.5] * 4, first_error=1),  # uniform
        response("p", "c", 0.0, [7, 8], [-0.5, -0.5]),  # wrong, error not placed
        response("p", "d", 1.0, [1, 9, 9, 9], [0.5, -0.1, 0.5, 0.5]),  # right, one negative token
        response("p", "e", 1.0, [1, 9, 9, 8], [0.5, 0.5, 0.5, 0.5]),
    ]
    summary = summarise([group], "all tokens")
    assert (summary.wrong_placed, summary.wrong_not_placed, summary.right, summary.blamed) == (2, 1, 2, 2)
    assert summary.on_error == pytest.approx((1.0 + 0.75) / 2)
    assert summary.right_steps_mean == pytest.approx((0.0 - 0.5) / 2)
    assert summary.right_steps_negative_share == 0.5
    assert summary.right_with_negative_share == 0.5 and summary.right_negative_position == pytest.approx(1 / 3)


def test_bootstrap_intervals_are_over_prompts():
    same = [[response(str(i), "a", 0.0, [1, 2], [0.0, -1.0], first_error=1)] for i in range(5)]
    assert bootstrap(same, "all tokens", resamples=50)["on_error"] == (1.0, 1.0)
    mixed = same + [[response("u", "a", 0.0, [1, 2], [-1.0, -1.0], first_error=1)]]
    low, high = bootstrap(mixed, "all tokens", resamples=400)["on_error"]
    assert 0.5 <= low < summarise(mixed, "all tokens").on_error < high <= 1.0


def test_inconsistent_responses_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        response("p", "a", 0.0, [1, 2], [0.1])
    with pytest.raises(ValueError, match="first_error 5 is not a token index"):
        response("p", "a", 0.0, [1, 2], [0.1, 0.1], first_error=5)
    with pytest.raises(ValueError, match="view must be one of"):
        summarise([[response("p", "a", 0.0, [1], [0.1])]], "everything")


in_session_loop = pytest.mark.asyncio(loop_scope="session")  # verl's server client lives there


@in_session_loop
async def test_tree_and_grpo_advantages_of_the_same_leaves_through_verl(llm_client, tiny_model):
    """Trees sampled by the spo_tree agent loop on verl's server, read through verl's advantage step:
    every SPO-tree token carries its node's V(node) - V(parent) (the plain reference, from the leaves'
    rewards), every segment with a non-zero advantage is trained by one row, the pooled view's segments
    carry the difference of their prefixes' mean leaf rewards, and GRPO's advantage of a response is
    one number, its reward against its prompt's others in verl's normalisation."""
    import statistics

    from spo_verl.algorithms import tree_advantages, tree_values
    from spo_verl.credit.rollouts import TreeSetup, rollout_config, sample_rollouts, tree_and_grpo_responses

    model_dir, tokenizer = tiny_model
    setup = TreeSetup("test", (3, 2), (6,))
    config = rollout_config(model_dir, setup, prompt_length=64, response_length=24)
    problems = [(f"c{i}", [{"role": "user", "content": f"Add {i} and {7 * i}."}], "") for i in range(3)]
    # A toy reward that varies between the tiny model's random answers: an even number of characters.
    score = lambda text, truth: float(len(text) % 2 == 0)  # noqa: E731
    leaves = await sample_rollouts(config, llm_client, tokenizer, problems, score=score)
    asked = []

    def locate(uid, texts, reward):  # the step checker's place: here only what it is given is checked
        asked.append((uid, "".join(texts), reward))
        return None

    views = tree_and_grpo_responses(leaves, config, tokenizer, 0.9, locate)
    tree, pooled, grpo = views["spo_tree"], views["spo_tree_pooled"], views["grpo"]
    assert len(tree) == len(pooled) == len(grpo) == len(leaves)
    for view in (tree, pooled, grpo):  # rewards that differ within a tree: credit to check
        assert any(a != 0 for response in view for a in response.advantages)
    # The checker reads each response's tokens as text, its end-of-sequence token included.
    assert asked == [(leaf.uid, tokenizer.decode(leaf.output.response_ids), leaf.score) for leaf in leaves]
    for uid in {leaf.uid for leaf in leaves}:
        members = [i for i, leaf in enumerate(leaves) if leaf.uid == uid]
        rows = [leaves[i].output.extra_fields["spo"] for i in members]
        ids = {"root": -1}
        for row in rows:
            parent = "root"
            for node in row["path"]:
                ids.setdefault(node, parent)
                parent = node
        order = list(ids)
        parents = [order.index(ids[n]) if ids[n] != -1 else -1 for n in order]
        rewards = {order.index(row["path"][-1]): 0.0 if row["truncated"] else leaves[i].score for i, row in zip(members, rows)}
        expected = dict(zip(order, tree_advantages(parents, tree_values(parents, rewards))))
        trained_nodes = []
        for i, row in zip(members, rows):
            start = 0
            for node, end in zip(row["path"], row["segment_ends"]):
                assert tree[i].advantages[start:end] == pytest.approx([expected[node]] * (end - start), abs=1e-6)
                # Pooled: V after and before the segment, each the mean reward of the tree's leaves
                # that share the prefix token for token.
                ids = leaves[i].output.response_ids
                value = lambda n: statistics.fmean(rewards[order.index(other["path"][-1])]  # noqa: E731
                                                   for j, other in zip(members, rows)
                                                   if list(leaves[j].output.response_ids[:n]) == list(ids[:n]))
                assert pooled[i].advantages[start:end] == pytest.approx([value(end) - value(start)] * (end - start), abs=1e-9)
                if any(tree[i].trained[start:end]):
                    trained_nodes.append(node)
                start = end
        assert sorted(trained_nodes) == sorted(n for n in order if n != "root" and expected[n] != 0)
        # GRPO: (reward - mean) / (std + eps) over the prompt's leaves, verl's default normalisation.
        scores = [leaves[i].score for i in members]
        mean, std = statistics.fmean(scores), statistics.stdev(scores) if len(scores) > 1 else 0.0
        for i in members:
            assert grpo[i].advantages == pytest.approx([(leaves[i].score - mean) / (std + 1e-6)] * len(grpo[i].tokens),
                                                       abs=1e-5)
            assert grpo[i].tokens == tree[i].tokens and grpo[i].in_loss == tree[i].in_loss
            # The probability mask: the rollout's probability of the token below 0.9.
            probabilities = [math.exp(lp) for lp in leaves[i].output.response_logprobs[: len(tree[i].tokens)]]
            assert list(tree[i].in_loss) == [p < 0.9 for p in probabilities]


def test_the_tables_recompute_from_responses_csv(tmp_path):
    """responses.csv holds everything the measures need: read back, it gives the same summary."""
    from spo_verl.credit.__main__ import Task, read_responses, summary_rows, write_responses, write_summary
    from spo_verl.credit.rollouts import TreeSetup

    task = Task("steps3", 3, "model", [], 0, 0, {})
    setup = TreeSetup("study", (2, 2), (10,))
    group = [
        response("p0", "a", 0.0, [1, 2, 3, 4], [0.25, 0.25, -0.5, -0.5], in_loss=[True, False, True, True],
                 trained=[True, True, True, True], first_error=2),
        response("p0", "b", 1.0, [1, 2, 5, 6], [0.25, 0.25, 0.5, 0.5], trained=[False, False, True, True]),
        response("p1", "c", 0.0, [7, 8], [-0.125, -0.125], first_error=1),
    ]
    path = tmp_path / "responses.csv"
    write_responses(path, [(task, setup, "spo_tree", r) for r in group])
    assert [r for _, r in read_responses(path)] == group
    packed = tmp_path / "responses.csv.gz"  # as docs/results/credit keeps it
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert [r for _, r in read_responses(packed)] == group
    rows = summary_rows(path, resamples=50)
    on_error = {row["view"]: row for row in rows if row["measure"] == "on_error"}
    assert on_error["all tokens"]["value"] == pytest.approx((1.0 + 0.5) / 2)
    assert (on_error["net"]["wrong_placed"], on_error["net"]["right"], on_error["net"]["prompts"]) == (2, 1, 2)
    write_summary(rows, tmp_path / "summary.csv", tmp_path / "table.md")
    assert "| steps3 | 3 | study | spo_tree | all tokens | 0.75 [" in (tmp_path / "table.md").read_text()


def test_the_paired_difference_to_grpo_is_over_the_same_responses():
    from spo_verl.credit.blame import paired_difference

    spo = [[response("p", "a", 0.0, [1, 2, 3, 4], [0, 0, -1, -1], first_error=2),
            response("p", "b", 0.0, [1, 5, 6, 7], [0, -1, -1, -1], first_error=3)]]
    grpo = [[response("p", "a", 0.0, [1, 2, 3, 4], [-0.5] * 4, first_error=2),
             response("p", "b", 0.0, [1, 5, 6, 7], [-0.5] * 4, first_error=3)]]
    # a: 1.0 against 0.5; b: 1/3 against 1/4.
    value, (low, high) = paired_difference(spo, grpo, "all tokens", resamples=20)
    assert value == pytest.approx(((1.0 - 0.5) + (1 / 3 - 0.25)) / 2) and low == high == pytest.approx(value)
