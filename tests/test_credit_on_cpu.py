"""The credit measures (spo_verl.core.credit.blame) with exact numbers on hand-built advantages: an estimator
that localises an error perfectly, GRPO's uniform advantage, the probability mask, and the net advantage
of identical tokens in the same context; and the rollouts they read, through verl's agent loop and
advantage step on verl's server."""

import csv
import gzip
import math
import os

import pytest

from spo_verl.core.credit.blame import Blame, Response, blame, bootstrap, negative_position, net_advantages, summarise


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


def test_online_metrics_of_a_step_name_every_measure_and_leave_out_what_is_undefined():
    from spo_verl.core.credit.online import credit_metrics

    # A perfect localiser on p0 (its wrong answer's negative mass all from token 2 on); p1 has one
    # wrong answer nobody blames and one whose error could not be placed.
    step = [response("p0", "a", 0.0, [1, 2, 3, 4], [0.0, 0.0, -1.0, -1.0], first_error=2),
            response("p0", "b", 1.0, [1, 2, 5, 6], [0.0, 0.0, 1.0, 1.0]),
            response("p1", "c", 0.0, [7, 8], [0.0, 0.0], first_error=1),
            response("p1", "d", 0.0, [7, 9], [0.0, 0.0])]
    metrics = credit_metrics(step)
    assert metrics == {
        "spo/credit/right_answers": 1.0, "spo/credit/wrong_answers_placed": 2.0,
        "spo/credit/wrong_answers_not_placed": 1.0, "spo/credit/wrong_answers_blamed": 1.0,
        "spo/credit/blame_on_error": 1.0, "spo/credit/blame_on_error_masked": 1.0, "spo/credit/blame_on_error_net": 1.0,
        "spo/credit/right_steps_advantage_mean": 0.0, "spo/credit/right_steps_negative_fraction": 0.0,
        "spo/credit/right_answers_negative_fraction": 0.0,
    }
    # Only right answers: no blame to measure, so no blame metric at all (not a 0 that reads as "none on the error").
    only_right = credit_metrics([response("p", "r", 1.0, [1], [0.0])])
    assert "spo/credit/blame_on_error" not in only_right and only_right["spo/credit/right_answers"] == 1.0


def test_value_check_prefixes_cover_boundaries_and_both_sides_of_the_first_error_round_robin():
    from spo_workbench.credit.values import Prefix, choose_prefixes

    boundaries = [[0, 4, 9], [0, 3], [0, 5], [0, 2]]
    first_errors = [6, None, 3, None]
    prompts = ["p0", "p0", "p1", "p1"]
    # Round robin: p0's first response, p1's first, then the second ones; the error adds 6 and 7.
    assert choose_prefixes(boundaries, first_errors, prompts, at_least=6) == [
        Prefix(0, 0, "boundary"), Prefix(0, 4, "boundary"), Prefix(0, 6, "before_error"), Prefix(0, 7, "after_error"),
        Prefix(0, 9, "boundary"),
        Prefix(2, 0, "boundary"), Prefix(2, 3, "before_error"), Prefix(2, 4, "after_error"), Prefix(2, 5, "boundary")]
    # An error at a boundary: the prefix is kept once, as the error's.
    assert choose_prefixes([[0, 3]], [3], ["p"], at_least=1) == [
        Prefix(0, 0, "boundary"), Prefix(0, 3, "before_error"), Prefix(0, 4, "after_error")]


def test_value_check_summary_bias_spread_and_the_change_across_the_error():
    from spo_workbench.credit.values import ValueRow, steps, summary

    def row(rid, reward, error, length, kind, estimate, reference):
        return ValueRow("p", rid, reward, error, length, kind, estimate, 4, reference, 32)

    rows = [  # a wrong answer: boundaries 0, 4, 9; error at 6
        row("w", 0.0, 6, 0, "boundary", 0.5, 0.5), row("w", 0.0, 6, 4, "boundary", 0.75, 0.625),
        row("w", 0.0, 6, 6, "before_error", 0.5, 0.5), row("w", 0.0, 6, 7, "after_error", 0.0, 0.125),
        row("w", 0.0, 6, 9, "boundary", 0.0, 0.0),
        # a right answer: boundaries 0, 5
        row("r", 1.0, None, 0, "boundary", 0.25, 0.5), row("r", 1.0, None, 5, "boundary", 1.0, 0.875)]
    changes = steps(rows)
    assert changes["wrong_token"] == [pytest.approx(0.125 - 0.5)]
    assert changes["wrong_segment"] == [pytest.approx(0.0 - 0.625)]  # 4 -> 9 holds the error
    assert sorted(changes["right_segment"]) == pytest.approx([0.125, 0.375])  # 0 -> 4 in w, 0 -> 5 in r
    result = summary(rows)
    errors = [0.0, 0.125, 0.0, -0.125, 0.0, -0.25, 0.125]
    assert result["bias"] == pytest.approx(sum(errors) / 7)
    mean = sum(errors) / 7
    assert result["spread"] == pytest.approx(math.sqrt(sum((e - mean) ** 2 for e in errors) / 6))
    assert (result["prefixes"], result["responses"], result["prompts"]) == (7, 2, 1)
    assert result["right_segment_change"] == pytest.approx(0.25) and result["wrong_token_count"] == 1


in_session_loop = pytest.mark.asyncio(loop_scope="session")  # verl's server client lives there


@in_session_loop
async def test_tree_and_grpo_advantages_of_the_same_leaves_through_verl(llm_client, tiny_model):
    """Trees sampled by the spo_tree agent loop on verl's server, read through verl's advantage step:
    every SPO-tree token carries its node's V(node) - V(parent) (the plain reference, from the leaves'
    rewards), every segment with a non-zero advantage is trained by one row, the pooled view's segments
    carry the difference of their prefixes' mean leaf rewards, and GRPO's advantage of a response is
    one number, its reward against its prompt's others in verl's normalisation."""
    import statistics

    from spo_verl.core.algorithms import tree_node_advantages, tree_values
    from spo_workbench.credit.rollouts import TreeSetup, rollout_config, sample_rollouts, tree_and_grpo_responses

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
        expected = dict(zip(order, tree_node_advantages(parents, tree_values(parents, rewards))))
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


@in_session_loop
async def test_chain_and_grpo_advantages_of_the_same_chains_and_their_values_checked_through_verl(llm_client, tiny_model):
    """Chains sampled by the spo_chain agent loop on verl's server, read through verl's advantage step:
    every token of segment j carries V(start of j + 1) - V(start of j) from the chain's own boundary
    values (the reward after the last), GRPO's rows are the same responses; the value check values
    the chosen prefixes with the estimate's and the reference's numbers of continuations."""
    import statistics

    from spo_workbench.credit.rollouts import ChainSetup, chain_and_grpo_responses, rollout_config, sample_rollouts
    from spo_workbench.credit.values import choose_prefixes, value_prefixes

    model_dir, tokenizer = tiny_model
    setup = ChainSetup("test", responses=3, cutpoint_interval=1, mc_samples=2)
    config = rollout_config(model_dir, setup, prompt_length=64, response_length=16)
    problems = [(f"c{i}", [{"role": "user", "content": f"Add {i} and {3 * i}."}], "7") for i in range(2)]
    score = lambda text, truth: float(len(text) % 2 == 0)  # noqa: E731  (the leaves' scores, for GRPO)
    leaves = await sample_rollouts(config, llm_client, tokenizer, problems, score=score)
    views = chain_and_grpo_responses(leaves, config, tokenizer, 0.9, lambda uid, texts, reward: None)
    chain, grpo = views["spo_chain"], views["grpo"]
    assert len(chain) == len(grpo) == len(leaves) == 6
    for i, leaf in enumerate(leaves):
        row = leaf.output.extra_fields["spo"]
        starts, values = row["segment_starts"], row["boundary_values"]
        # The continuations behind the values are scored by verl's GSM8K reward, the response itself
        # (the reward after the last segment) by the toy score; a truncated response scores 0.
        ends = [*starts[1:], len(leaf.output.response_ids)]
        # Before the first segment, or everywhere when no token fell below the threshold: no credit.
        expected = [0.0] * (starts[0] if starts else len(leaf.output.response_ids))
        after = [*values[1:], 0.0 if row["truncated"] else leaf.score]
        for start, end, before, later in zip(starts, ends, values, after):
            expected += [later - before] * (end - start)
        assert list(chain[i].advantages) == pytest.approx(expected, abs=1e-6)
        assert chain[i].mc_tokens == row["chain"]["mc_tokens"] and grpo[i].tokens == chain[i].tokens
    for uid in ("c0", "c1"):
        members = [i for i, leaf in enumerate(leaves) if leaf.uid == uid]
        scores = [leaves[i].score for i in members]
        mean, std = statistics.fmean(scores), statistics.stdev(scores)
        for i in members:
            assert grpo[i].advantages == pytest.approx([(leaves[i].score - mean) / (std + 1e-6)] * len(grpo[i].tokens), abs=1e-5)
    chosen = choose_prefixes([leaf.output.extra_fields["spo"]["segment_starts"] for leaf in leaves], [None] * 6,
                             [leaf.uid for leaf in leaves], at_least=4)

    async def always_right(token_ids, uid):  # every continuation scores 1 unless cut by the length limit
        return 1.0

    rows = await value_prefixes(llm_client, leaves, chosen, always_right, estimate_samples=2, reference_samples=5,
                                response_length=16, eos_token_ids={tokenizer.eos_token_id}, first_errors=[None] * 6)
    assert [(r.response_id, r.length, r.kind) for r in rows] == [
        (f"{leaves[p.response].uid}-{p.response}", p.length, p.kind) for p in chosen]
    for r in rows:
        assert r.estimate * 2 == round(r.estimate * 2) and r.reference * 5 == pytest.approx(round(r.reference * 5))
        assert (r.estimate_samples, r.reference_samples) == (2, 5)


@in_session_loop
async def test_the_credit_command_measures_tree_chain_and_grpo_on_the_same_responses(llm_client, cpu_tiny_cache, tmp_path,
                                                                                     monkeypatch):
    """``python -m spo_workbench.credit --quick`` on verl's server: its task measured (trees and chains
    through the agent loops, every estimator through verl's advantage step, the value check) and kept as
    the sweep keeps a finished task, then the command itself, which keeps that task and writes the
    sweep's files. The session's server serves the cpu-tiny setting's model without its fine-tuning, so
    here the answers are wrong and unplaced; the page's example is checked on placed ones below."""
    from spo_verl.adapters.cpu_platform.environment import cpu_run_env
    from spo_workbench.credit.__main__ import QUICK_SETUPS, ValueCheck, keep_task, main, measure_task, tiny_task

    monkeypatch.setenv("SPO_CPU_CACHE", str(cpu_tiny_cache))
    for key, value in cpu_run_env().items():  # what the command sets, restored after the test
        monkeypatch.setenv(key, os.environ.get(key, value))
    task = tiny_task(4)
    output = tmp_path / "output"
    (output / "tasks").mkdir(parents=True)
    keep_task(output / "tasks", task, *await measure_task(task, list(QUICK_SETUPS.values()), ValueCheck(12, 8),
                                                          client=llm_client))
    assert main(["--quick", "--prompts", "4", "--output-dir", str(output)]) == 0
    with open(output / "responses.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    # Every leaf once per estimator, GRPO's and the pooled rows over the same responses as SPO-tree's;
    # every chain once as SPO-chain's and once as GRPO's, with the tokens its Monte Carlo values cost.
    by_estimator = {e: [(r["response_id"], r["tokens"], r["reward"]) for r in rows if r["estimator"] == e and r["setup"] == "tiny"]
                    for e in ("spo_tree", "spo_tree_pooled", "grpo")}
    assert by_estimator["spo_tree"] and by_estimator["spo_tree"] == by_estimator["grpo"] == by_estimator["spo_tree_pooled"]
    chains = {e: [(r["response_id"], r["tokens"], r["reward"]) for r in rows if r["estimator"] == e and r["setup"] == "tiny_chain"]
              for e in ("spo_chain", "grpo")}
    assert len(chains["spo_chain"]) == 3 * 4 and chains["spo_chain"] == chains["grpo"]
    # A boundary prefix shared by a prompt's chains is valued once and charged to the chain that asked first,
    # so a chain may cost nothing, but each prompt's chains together cost their continuations.
    mc_by_prompt: dict[str, int] = {}
    for r in rows:
        if r["estimator"] == "spo_chain":
            mc_by_prompt[r["prompt_uid"]] = mc_by_prompt.get(r["prompt_uid"], 0) + int(r["mc_tokens"])
    assert len(mc_by_prompt) == 4 and all(tokens > 0 for tokens in mc_by_prompt.values()), mc_by_prompt
    assert {r["prompt_uid"] for r in rows} == {f"p{i}" for i in range(4)}
    for row in rows:
        length = int(row["length"])
        assert len(row["advantages"].split()) == len(row["in_loss"].split()) == len(row["tokens"].split()) == length
        if row["first_error_token"]:
            assert float(row["reward"]) < 1 and 0 <= int(row["first_error_token"]) < length
    table = (output / "table.md").read_text()
    assert "| tiny_add | 1 | tiny | spo_tree | all tokens |" in table and "| tiny_add | 1 | tiny | grpo | net |" in table
    with open(output / "summary.csv", newline="") as handle:
        summary = list(csv.DictReader(handle))
    assert {r["estimator"] for r in summary} >= {"spo_tree", "spo_tree_pooled", "spo_chain", "grpo"}
    # The value check on the chains' prefixes: each valued by the chain's 4 continuations and a reference of 8.
    with open(output / "values.csv", newline="") as handle:
        values = list(csv.DictReader(handle))
    assert len(values) >= 12 and {v["kind"] for v in values} <= {"boundary", "before_error", "after_error"}
    assert all((v["estimate_samples"], v["reference_samples"]) == ("4", "8") for v in values)
    assert {v["response_id"] for v in values} <= {r["response_id"] for r in rows if r["setup"] == "tiny_chain"}
    assert "| tiny_add |" in (output / "values.md").read_text()
    assert "values_calibration.png" in (output / "credit.html").read_text()
    assert (output / "values_calibration.png").stat().st_size > 0


def test_the_tables_recompute_from_responses_csv(tmp_path):
    """responses.csv holds everything the measures need: read back, it gives the same summary."""
    from spo_workbench.credit.__main__ import (Task, read_responses, summary_rows, write_responses, write_summary,
                                                write_views)
    from spo_workbench.credit.rollouts import TreeSetup

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
    # The page shows the first placed wrong answer that every estimator blames, under each of them.
    grpo = [response(r.prompt_uid, r.response_id, r.reward, r.tokens, [0.5 if r.reward else -0.5] * len(r.tokens),
                     first_error=r.first_error) for r in group]
    write_responses(path, [(task, setup, "spo_tree", r) for r in group] + [(task, setup, "grpo", r) for r in grpo])
    write_views(tmp_path, lambda token: f"<t{token}>")
    page = (tmp_path / "credit.html").read_text()
    assert "<h2>steps3, study" in page and "&lt;t3&gt;" in page


def test_the_paired_difference_to_grpo_is_over_the_same_responses():
    from spo_verl.core.credit.blame import paired_difference

    spo = [[response("p", "a", 0.0, [1, 2, 3, 4], [0, 0, -1, -1], first_error=2),
            response("p", "b", 0.0, [1, 5, 6, 7], [0, -1, -1, -1], first_error=3)]]
    grpo = [[response("p", "a", 0.0, [1, 2, 3, 4], [-0.5] * 4, first_error=2),
             response("p", "b", 0.0, [1, 5, 6, 7], [-0.5] * 4, first_error=3)]]
    # a: 1.0 against 0.5; b: 1/3 against 1/4.
    value, (low, high) = paired_difference(spo, grpo, "all tokens", resamples=20)
    assert value == pytest.approx(((1.0 - 0.5) + (1 / 3 - 0.25)) / 2) and low == high == pytest.approx(value)


def test_the_papers_shapes_follow_each_task_and_are_the_gradient_measurements_own():
    """The credit command's 6-6-6 tree takes two segments of a quarter of each task's mean answer (29, 42
    and 53 tokens at k = 2, 3, 4), the int5 chain 9 Monte Carlo samples a boundary, and the gradient
    measurement's estimators of the same names sample exactly these."""
    from spo_workbench.credit.__main__ import SMOLLM2_SETUPS, setup_for
    from spo_workbench.credit.gradients import smollm2_estimators

    trees = {task: setup_for(SMOLLM2_SETUPS["6_6_6"], task) for task in ("steps2", "steps3", "steps4")}
    assert {task: (tree.branching, tree.segment_tokens, tree.branch_at) for task, tree in trees.items()} == {
        "steps2": ((6, 6, 6), (7, 7), "fixed"), "steps3": ((6, 6, 6), (10, 10), "fixed"),
        "steps4": ((6, 6, 6), (13, 13), "fixed")}
    chain = setup_for(SMOLLM2_SETUPS["int5_mc9"], "steps3")
    assert (chain.responses, chain.cutpoint_interval, chain.mc_samples) == (4, 5, 9)
    assert setup_for(SMOLLM2_SETUPS["study"], "steps3") is SMOLLM2_SETUPS["study"]
    for task in ("steps3", "steps4"):
        estimators = {estimator.name: estimator.setup for estimator in smollm2_estimators(task)}
        assert estimators["spo_tree_6_6_6"] == trees[task] and estimators["spo_chain_int5_mc9"] == chain
