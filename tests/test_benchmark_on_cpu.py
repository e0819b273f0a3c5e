"""The benchmark command (``bash scripts/benchmark.sh``, ``spo_workbench.benchmarks``) cannot rot: its quick
configuration runs here, the packed-training measurement (``python -m spo_workbench.benchmarks.packing --json
--quick``, verl's actor worker on CPU) counts exactly the trees' unique tokens, and a 2-2 tree through
verl's real rollout path (the session's verl server) generates exactly its analytic token count."""

import math
import re

import pytest

from spo_workbench.benchmarks import cli, tokens, tree_rollout
from spo_workbench.benchmarks.report import Report, header, render
from spo_workbench.benchmarks.tree_rollout import LATENCY, TreeCase
from spo_workbench.benchmarks.tree_rollout_report import tree_section
from spo_verl.core.rollout.tree import aligned_budgets

in_session_loop = pytest.mark.asyncio(loop_scope="session")  # the server's client lives there


@pytest.fixture(scope="module")
def packing_results():
    """``python -m spo_workbench.benchmarks.packing --json --quick`` in a fresh process, once for this module."""
    return cli.run_packing(quick=True, repeats=2, threads=1)


def test_quick_packed_training_counts_unique_tokens(packing_results):
    shapes = packing_results["shapes"]
    assert [shape["shape"] for shape in shapes] == ["3-3"]
    for shape in shapes:
        # The packed engine's own metric: each tree's prompt and nodes once, for one micro-batch.
        assert shape["packed_tokens"] == shape["unique_tokens"] < shape["row_tokens"]
        assert shape["metric_row_tokens"] == shape["row_tokens"]
        assert shape["rows"] == shape["trees"] * 9
        assert len(shape["per_row_seconds"]) == len(shape["packed_seconds"]) == 2
        assert all(seconds > 0 for seconds in shape["per_row_seconds"] + shape["packed_seconds"])
        assert shape["speedup"] > 0 and all(peak >= 0 for peak in shape["peak_mib"].values())
        assert shape["loss_rel_diff"] < 1e-4
    report = Report()
    cli.packing_section(report, packing_results)
    text = render(report, header("test", 1, None))
    assert "## 7. Packed SPO-tree training: one actor update pass" in text
    assert re.search(r"^\| 7\. packed tokens == the batch's unique tokens \(its distinct prefixes\) \| .*? \| hit \|$", text,
                     flags=re.MULTILINE)
    assert re.search(r"^\| 7\. actor update time falls with the tokens \| .*? \| (hit|\*\*MISS\*\* \S.*) \|$", text,
                     flags=re.MULTILINE)
    assert "| 356,400 (216 rows) | 90,150 (3.95x) |" in text


def test_quick_maths_report_has_every_section_and_target(tmp_path, monkeypatch, packing_results):
    monkeypatch.setattr(cli, "run_packing", lambda quick, repeats, threads: packing_results)  # run once, above
    output = tmp_path / "BENCHMARKS.md"
    text = cli.main(["--quick", "--skip-rollout", "--output", str(output)])
    assert output.read_text() == text
    for line in ("# Benchmarks", "* Date:", "* Machine:", "* Versions:", "* GPU: none lent"):
        assert line in text
    headings = re.findall(r"^## (\S+)", text, flags=re.MULTILINE)
    assert headings == ["Targets", "3.", "3b.", "4.", "5.", "6.", "7."]
    targets = re.findall(r"^\| ([1-7]\..*?) \| (.*?) \| (.*?) \| (hit|\*\*MISS\*\*|reported)", text, flags=re.MULTILINE)
    names = [name for name, *_ in targets]
    assert sum(n.startswith("3. `spo_") and "vs verl `grpo`" in n for n in names) == 2
    assert sum(n.startswith("4. `spo_prob_mask") for n in names) == 2
    assert any(n.startswith("3. batched chain advantages") for n in names)
    assert any(n.startswith("5. training tokens per step, paper") for n in names)
    assert "7. packed tokens == the batch's unique tokens (its distinct prefixes)" in names and "7. actor update time falls with the tokens" in names
    for name, target, measured, result in targets:
        if result == "**MISS**":
            assert re.search(r"\*\*MISS\*\* \S", text.split(name, 1)[1].splitlines()[0]), f"a miss needs its reason: {name}"
    # Every ratio is printed with its spread.
    assert re.search(r"\d+\.\d+x \(\d+\.\d+-\d+\.\d+\)", text)
    memory_rows = re.findall(r"^\| (estimator-\S+|loss/\S+) \| (\d+) \| (\d+) \|$", text, flags=re.MULTILINE)
    assert len(memory_rows) == 7


def test_analytic_counts():
    assert tree_rollout.analytic_tree_tokens((2, 2), (16,), 32) == 2 * 16 + 4 * 16
    assert tree_rollout.analytic_tree_tokens((6, 6, 6), (8, 8), 32) == 6 * 8 + 36 * 8 + 216 * 16
    # Aligned to 16-token blocks, a 37-token prompt's first segment grows to 28 (37 + 28 = 4 * 16 + 1);
    # the second, a whole number of blocks, keeps the alignment.
    assert aligned_budgets(37, (16, 32), 16) == (28, 32)
    assert aligned_budgets(37, (16, 32), None) == (16, 32)
    assert tree_rollout.analytic_tree_tokens((6, 6, 6), (28, 32), 96) == 6 * 28 + 36 * 32 + 216 * 36
    paper = tokens.paper_counts()
    assert paper["spo_tree_rows"] == 356_400 and paper["unique"] == 90_150  # the paper setting: 6-6-6 trees, 30 prompts a step (workbench/spo_workbench/benchmarks/tokens.py)


def test_a_case_whose_tree_does_not_fit_its_response_is_refused_when_defined():
    """The agent loop's own check, at definition: aligned to 32, segments [16, 16] can take 16 + 31 +
    32 = 79 tokens, so a 64-token response is refused and an 80-token one is not."""
    with pytest.raises(ValueError, match=r"can use 79 tokens .*rollout\.response_length=64"):
        TreeCase("6-6-6", (16, 16), 64, 1, tree_rollout.THROUGHPUT, align_to_block=32)
    assert TreeCase("6-6-6", (16, 16), 80, 1, tree_rollout.THROUGHPUT, align_to_block=32).leaves == 216


def test_an_engine_iterations_cost_is_fitted_against_its_work():
    """Rounds whose iterations cost exactly 10 ms plus 0.1 ms per token of work give back (10, 0.1)."""
    from spo_workbench.benchmarks.rollout import Counts, EngineStats, Side
    from spo_workbench.benchmarks.timing import Comparison
    from spo_workbench.benchmarks.tree_rollout import THROUGHPUT, TreeResult
    from spo_workbench.benchmarks.tree_rollout_report import fitted_wall_over_work, iteration_cost

    def side(points):  # (generated tokens, iterations) per round, no prompt tokens computed
        rounds = [{"seconds": iterations * (10 + 0.1 * generated / iterations) / 1e3, "counts": Counts(1, 0, 0, generated),
                   "engine": EngineStats(iterations, 0.0, 0, None), "output": None} for generated, iterations in points]
        return Side("s", None, None, [], 1, rounds)

    case = TreeCase("2-2", (32,), 96, 8, THROUGHPUT)
    result = TreeResult(case, Comparison(), side([(1000, 100), (3000, 100)]), side([(5000, 50)]), 0.01)
    fixed, per_token = iteration_cost([result], THROUGHPUT)
    assert fixed == pytest.approx(10.0) and per_token == pytest.approx(0.1)
    assert iteration_cost([result], LATENCY) is None  # no latency-bound case here
    # Rounds that follow the fitted cost exactly: the prediction is the measured wall / work, here for the
    # one pair of rounds, tree 100 x 10 + 0.1 x 1000 = 1100 ms against 50 x 10 + 0.1 x 5000 = 1000 ms, at
    # a fifth of the work.
    assert fitted_wall_over_work(result, (fixed, per_token)) == pytest.approx(1100 / 1000 / 0.2)
    assert result.wall_over_work() == pytest.approx(1100 / 1000 / 0.2)


@in_session_loop
async def test_tree_rollout_generates_its_analytic_count_through_verls_worker(verl_server, tiny_model):
    model_dir = tiny_model[0]
    case = TreeCase("2-2", (8,), 24, 1, LATENCY)
    result = await tree_rollout.benchmark_tree(verl_server, model_dir, case, rounds=2)
    assert result.early_stops == 0
    analytic = 2 * 8 + 4 * 16
    assert result.analytic_generated() == analytic
    assert len(result.tree.rounds) == len(result.independent.rounds) == 2
    # One timer: the comparison's seconds are the sides' own step timers.
    assert result.comparison.a_seconds == [r["seconds"] for r in result.tree.rounds]
    assert result.comparison.b_seconds == [r["seconds"] for r in result.independent.rounds]
    tree = result.tree.rounds[-1]
    independent = result.independent.rounds[-1]
    assert tree["counts"].generated_tokens == analytic == tree_rollout.tree_generated_from_metadata(tree["output"])
    assert tree["counts"].requests == 2 + 4
    assert independent["counts"].generated_tokens == 4 * 24 and independent["counts"].requests == 4
    assert tree["vllm"] is None and tree["engine"] is None  # the session server runs with vLLM's statistics off
    # The prefix cache is emptied before every step: each step computes its first request's prompt in full.
    prompt = int(tree["output"].batch["attention_mask"][0, : tree["output"].batch["prompts"].shape[1]].sum())
    assert tree["counts"].computed_prompt_tokens >= prompt and independent["counts"].computed_prompt_tokens >= prompt
    assert tree_rollout.critical_path(tree["output"]) == (24, 2)
    assert tree_rollout.critical_path(independent["output"]) == (24, 1)
    assert tree_rollout.work(tree["counts"]) == analytic + tree["counts"].computed_prompt_tokens
    assert 0 < result.round_trip_seconds < 5
    # Training rows: 4 leaf rows of prompt + 24 tokens each; the tree's unique tokens once.
    assert tree_rollout.training_rows(tree["output"]) == {"rows": 4, "tokens": 4 * (prompt + 24)}
    assert tree_rollout.tree_unique_tokens(tree["output"]) == prompt + analytic
    report = Report()
    tree_section(report, [result])
    cli.training_tokens_section(report, result)
    text = render(report, header("test", 1, None))
    assert "| **latency-bound** 2-2, 1 x 4, forced length, segments [8] unaligned |" in text
    assert re.search(r"^\| `spo_tree` \| [\d.]+ \| 6 \| 80 \| 80 \| \d+ / \d+ \| [\d,]+ \| 24 / 2 \|", text, flags=re.MULTILINE)
    assert re.search(r"^\| `single_turn_agent` \| [\d.]+ \| 4 \| 96 \| 96 \| .*? \| 24 / 1 \|", text, flags=re.MULTILINE)
    assert re.search(r"\| 1\. `spo_tree` 2-2 latency-bound: generated tokens = analytic count \| .*? \| hit \|", text)
    # The same section for another model is numbered apart and names its model.
    from spo_workbench.benchmarks.tree_rollout_report import SMOLLM2_MODEL

    other = Report()
    tree_section(other, [result], "1b", SMOLLM2_MODEL)
    other_text = render(other, header("test", 1, None))
    assert "1b. Tree rollout against independent sampling, through verl's rollout path, on SmolLM2-135M-Instruct" in other_text
    assert re.search(r"\| 1b\. `spo_tree` 2-2 latency-bound: generated tokens = analytic count \| .*? \| hit \|", other_text)
    assert re.search(r"\| 1\. 2-2, 1 x 4, forced length, segments \[8\] unaligned, latency-bound: tree's extra wall time \| .*? \| (hit|\*\*MISS\*\* \S.*) \|$", text,
                     flags=re.MULTILINE)  # timed on a shared CPU: either, a miss with its reason
    assert re.search(r"\| 5\. training tokens per step, `spo_tree` 2-2 .*? \| hit \|", text)
    assert math.isfinite(result.comparison.ratio)


def test_the_step_section_says_what_the_credit_metrics_cost_against_the_same_step():
    """The step benchmark's runs train through verl's trainer (minutes each); the section is checked on
    their result's shape: the credit metrics' share of the packed run's step against its target."""
    from spo_workbench.benchmarks.step import PACKED, PER_ROW, PHASES

    def run(configuration, step_seconds, credit_share):
        return {"algorithm": "spo_tree", "configuration": configuration, "phases": {p: step_seconds for p in PHASES},
                "step_all": step_seconds, "step_times": [step_seconds] * 3, "updated": [True] * 3,
                "update_tokens": {"forwarded": None, "unique": None, "rows": None, "exact": True},
                "generated_tokens": 100.0, "peak_memory_gib": 1.0, "wall_s": 1.0, "credit_share": credit_share}

    report = Report()
    cli.step_section(report, {"setting": "cpu-smollm2", "steps": 3,
                              "runs": [run(PER_ROW, 30.0, 0.0004), run(PACKED, 12.0, 0.00125)]})
    text = render(report, header("test", 1, None))
    assert "| 8. `spo_tree` credit metrics (`spo/credit/*`) share of a training step | < 1% | 0.125% (median of steps 2-3) | hit |" in text
    missed = Report()
    cli.step_section(missed, {"setting": "cpu-smollm2", "steps": 3,
                              "runs": [run(PER_ROW, 30.0, None), run(PACKED, 12.0, 0.02)]})
    assert "| 2.000% (median of steps 2-3) | **MISS** reading the batch costs more than planned |" in render(missed, header("test", 1, None))


def test_a_memory_case_reports_its_peak_above_the_reset_mark_never_below_it():
    from spo_workbench.benchmarks.timing import measure_memory_case

    idle = measure_memory_case(lambda: (lambda: None))
    assert idle["peak_mib"] >= 0  # nothing allocated: 0, never the "-0" of a baseline read before the reset

    def allocating():
        return lambda: bytearray(64 * 2**20)  # 64 MiB, touched (zero-filled), then freed

    assert 60 <= measure_memory_case(allocating)["peak_mib"] < 200
