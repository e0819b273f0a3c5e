"""The study's declared comparisons: accuracy at exactly the token budget, paired seeds, the interval,
the verdict and the minimum detectable difference, with exact numbers."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from spo_workbench.student_t import t_quantile
from spo_workbench.study.verdict import Arm, arms, at_budget, main, paired, validations


def test_accuracy_at_the_budget_is_interpolated_between_the_validations_around_it():
    points = [(0.0, 0.2), (5_000.0, 0.3), (10_400.0, 0.5)]
    assert at_budget(points, 10_000) == pytest.approx(0.3 + 0.2 * 5_000 / 5_400)
    assert at_budget(points, 5_000) == pytest.approx(0.3)
    assert at_budget(points, 12_000) is None  # short of the budget: not extrapolated
    assert at_budget([(0.0, 0.2), (800.0, 0.4)], 800) == pytest.approx(0.4)


def test_validations_read_cumulative_tokens_and_greedy_accuracy_from_the_logged_steps():
    key = "val-core/openai/gsm8k/acc/mean@1"
    steps = [(0, {key: 0.25}), (1, {"spo/generated_tokens_cumulative": 900.0}),
             (2, {key: 0.5, "spo/generated_tokens_cumulative": 1800.0}),
             (3, {"val-core/openai/gsm8k/acc/mean@4": 0.4, "spo/generated_tokens_cumulative": 2700.0})]
    assert validations(steps) == [(0.0, 0.25), (1800.0, 0.5)]


def test_student_t_quantiles():
    # Tabulated values: t(0.975, 7) = 2.365, t(0.9875, 9) = 2.685, t(0.8, 7) = 0.896, t(0.5, df) = 0.
    assert t_quantile(0.975, 7) == pytest.approx(2.3646, abs=1e-3)
    assert t_quantile(0.9875, 9) == pytest.approx(2.6850, abs=1e-3)
    assert t_quantile(0.8, 7) == pytest.approx(0.8960, abs=1e-3)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)


def test_paired_seeds_give_the_mean_difference_its_interval_verdict_and_detectable_size():
    at = {("spo", s): 0.30 + 0.01 * s for s in range(4)}
    at.update({("grpo", s): 0.20 + 0.02 * s for s in range(4)})
    at[("spo", 4)] = 0.9  # a seed the reference did not finish: left out
    at[("grpo", 5)] = None
    result = paired(at, "spo", "grpo", level=0.95)
    differences = [0.10, 0.09, 0.08, 0.07]
    assert result.seeds == (0, 1, 2, 3) and result.differences == pytest.approx(differences)
    se = math.sqrt(sum((d - 0.085) ** 2 for d in differences) / 3) / 2
    assert result.mean == pytest.approx(0.085) and result.se == pytest.approx(se)
    t = t_quantile(0.975, 3)
    assert (result.low, result.high) == pytest.approx((0.085 - t * se, 0.085 + t * se))
    assert result.detectable == pytest.approx((t + t_quantile(0.8, 3)) * se)
    assert result.verdict == "better"
    assert paired({k: -v if v is not None else None for k, v in at.items()}, "spo", "grpo").verdict == "worse"
    noisy = paired({("a", 0): 0.5, ("b", 0): 0.4, ("a", 1): 0.3, ("b", 1): 0.4}, "a", "b")
    assert noisy.verdict == "not resolved" and noisy.low < 0 < noisy.high
    assert paired({("a", 0): 0.5, ("b", 0): 0.4}, "a", "b").verdict == "not resolved (too few seeds)"


def test_the_command_reads_finished_runs_and_writes_each_runs_value(tmp_path, capsys):
    key = "val-core/openai/gsm8k/acc/mean@1"
    for algorithm, gains in (("spo", (0.2, 0.3)), ("grpo", (0.1, 0.1))):
        for seed, gain in enumerate(gains):
            folder = tmp_path / algorithm / f"seed{seed}"
            folder.mkdir(parents=True)
            lines = [{"step": 0, "data": {key: 0.1}},
                     {"step": 1, "data": {key: 0.1 + gain, "spo/generated_tokens_cumulative": 1000.0}}]
            (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
            sampled = {"final_sampled_accuracy": 0.05 + gain} if algorithm == "spo" or seed == 0 else {}
            (folder / "done.json").write_text(json.dumps(sampled))
    unfinished = tmp_path / "spo" / "seed2"
    unfinished.mkdir()
    (unfinished / "metrics.jsonl").write_text(json.dumps({"step": 0, "data": {key: 0.1}}) + "\n")
    assert main(["--output-dir", str(tmp_path), "--budget", "500", "--compare", "spo-grpo", "--csv",
                 str(tmp_path / "runs.csv"), "--plot", str(tmp_path / "plot" / "paired.png")]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1])[0]
    # At 500 tokens: half way from the base model (0.1) to each run's step-1 accuracy.
    assert result["differences"] == pytest.approx([0.05, 0.1]) and result["seeds"] == [0, 1]
    # Each run's final sampled accuracy beside it (grpo's seed 1 had no sampled validation).
    assert (tmp_path / "runs.csv").read_text().splitlines() == [
        "algorithm,seed,accuracy_at_budget,final_sampled_accuracy", "grpo,0,0.150000,0.150000", "grpo,1,0.150000,",
        "spo,0,0.200000,0.250000", "spo,1,0.250000,0.350000"]
    # Secondary: each arm at the budget (0.225 +- 0.025 and 0.150 +- 0), and the sampled accuracy's one
    # complete pair, too few seeds for an interval.
    assert "| spo | 2 | 0.225 | 0.025 |" in out and "| grpo | 2 | 0.150 | 0.000 |" in out
    assert "| grpo | 1 | 0.150 | - |" in out
    sampled_pair = out.split("sampled accuracy")[1].split("The declared comparisons")[0]
    assert "| spo minus grpo | 1 | +10.0 | - | [-, -] | - | not resolved (too few seeds) |" in sampled_pair
    # The declared comparison drawn: a picture with ink in it (two seeds: the mean, no interval).
    with Image.open(tmp_path / "plot" / "paired.png") as image:
        pixels = np.asarray(image.convert("L"))
    assert pixels.shape[1] > 500 and (pixels < 128).mean() > 0.005
    # A misspelt arm is refused with the finished ones named; a run short of the budget is named as left out.
    with pytest.raises(SystemExit):
        main(["--output-dir", str(tmp_path), "--budget", "500", "--compare", "spo-gpro"])
    assert "--compare names ['gpro'], which have no finished run" in capsys.readouterr().err
    assert main(["--output-dir", str(tmp_path), "--budget", "1500", "--compare", "spo-grpo"]) == 0
    assert "no validation reaches 1,500 tokens in grpo/seed0, grpo/seed1, spo/seed0, spo/seed1" in capsys.readouterr().err


def test_each_arm_is_its_mean_over_the_seeds_with_a_value_and_their_standard_error():
    at = {("a", 0): 0.2, ("a", 1): 0.4, ("a", 2): None, ("b", 0): 0.3}
    assert arms(at) == [Arm("a", 2, pytest.approx(0.3), pytest.approx(0.1)), Arm("b", 1, 0.3, None)]
    assert arms({("c", 0): None}) == [Arm("c", 0, None, None)]


def test_the_tuning_rule_takes_each_algorithms_best_rate_and_the_lower_one_on_a_tie(tmp_path, capsys):
    """The declared rule, on the third study's own sweep (every arm best at 5e-6) and on a made-up one:
    the highest accuracy at the budget, a tie to the lower rate, a run short of the budget no candidate."""
    from pathlib import Path

    from spo_workbench.study import tuning

    study3 = Path(__file__).resolve().parents[1] / "docs" / "results" / "study3"
    rates = [f"{lr}={study3 / f'tune_lr{lr}.csv'}" for lr in ("5e-6", "1e-5", "2e-5")]
    assert tuning.main([*sum((["--rate", r] for r in rates), []), "--csv", str(tmp_path / "chosen.csv")]) == 0
    assert capsys.readouterr().out.strip() == "grpo=5e-6,grpo_prob_mask=5e-6,spo_tree_cutpoint=5e-6"
    # The choice the third study made by hand (its chosen_rates.csv), row for row.
    assert sorted((tmp_path / "chosen.csv").read_text().splitlines()) == sorted((study3 / "chosen_rates.csv").read_text().splitlines())
    sweep = {"a": {"1e-5": 0.5, "5e-6": 0.5, "2e-5": 0.4}, "b": {"1e-5": 0.3, "5e-6": None, "2e-5": 0.6}}
    assert tuning.choose(sweep) == {"a": ("5e-6", 0.5), "b": ("2e-5", 0.6)}
    with pytest.raises(ValueError, match="c: no tuning run reached the budget"):
        tuning.choose({"c": {"1e-5": None}})


def test_the_paired_plot_draws_each_comparison_with_its_interval(tmp_path):
    from spo_workbench.study.verdict_plot import plot_paired

    at = {("spo", s): 0.30 + 0.01 * s for s in range(4)}
    at.update({("grpo", s): 0.20 + 0.02 * s for s in range(4)})
    at.update({("chain", s): 0.25 - 0.01 * (s % 2) for s in range(4)})
    results = [paired(at, "spo", "grpo"), paired(at, "chain", "grpo")]
    assert [r.verdict for r in results] == ["better", "not resolved"]
    path = plot_paired(results, 16_000, tmp_path / "paired.png")
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    # Taller with two comparisons than the one-row minimum, and the zero line drawn in red.
    assert pixels.shape[0] > 200 and ((pixels[..., 0] > 180) & (pixels[..., 1] < 80) & (pixels[..., 2] < 80)).sum() > 50


def test_a_run_that_trained_past_its_budgets_step_is_named(tmp_path, capsys):
    """Over its attempts: 400 tokens a step against a 1,000-token budget choose step 3 (400 + 400 + 400 >= 1,000
    after step 2), so a run that ended at step 4 trained one step too many."""
    from spo_workbench.study.verdict import runs_past_their_budget

    key = "val-core/openai/gsm8k/acc/mean@1"
    for name, steps in (("kept", 3), ("over", 4)):
        folder = tmp_path / name / "seed0"
        folder.mkdir(parents=True)
        first = [{"step": 0, "data": {key: 0.1}}] + [{"step": s, "data": {"spo/generated_tokens": 400.0}} for s in (1, 2)]
        second = [{"step": s, "data": {"spo/generated_tokens": 400.0, key: 0.2}} for s in range(3, steps + 1)]
        (folder / "metrics-attempt1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in first))
        (folder / "metrics-attempt2.jsonl").write_text("".join(json.dumps(line) + "\n" for line in second))
        (folder / "attempts.json").write_text(json.dumps([{"metrics": "metrics-attempt1.jsonl", "resumed_from": 0},
                                                          {"metrics": "metrics-attempt2.jsonl", "resumed_from": 2}]))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in first + second))
        (folder / "done.json").write_text(json.dumps({"steps": steps}))
    assert runs_past_their_budget(tmp_path, 1_000) == ["over/seed0 (4 steps, the budget chose 3)"]
    assert runs_past_their_budget(tmp_path, 5_000) == []  # the step bound ended both
    assert main(["--output-dir", str(tmp_path), "--budget", "500", "--training-budget", "1000"]) == 0
    assert ("Runs that trained past the step their 1,000-token budget chose: over/seed0 (4 steps, the budget chose 3)"
            in capsys.readouterr().out)


def test_seed_pairs_needed_by_the_exact_noncentral_t_from_the_studies_at_budget_csv():
    """RESULTS.md's seed counts: the paired differences' standard deviation from each study's
    at_budget.csv, the fewest pairs for 80 % power at 97.5 % (the declared level) by the exact noncentral
    t, a few more than the normal approximation's ((z + z) sd / d)^2."""
    import csv
    import statistics
    from pathlib import Path

    from spo_workbench.student_t import paired_t_power, pairs_needed

    results = Path(__file__).resolve().parents[1] / "docs" / "results"

    def sd(study, arm, reference):
        with open(results / study / "at_budget.csv", newline="") as handle:
            at = {(r["algorithm"], int(r["seed"])): float(r["accuracy_at_budget"]) for r in csv.DictReader(handle)}
        seeds = sorted(s for a, s in at if a == arm and (reference, s) in at)
        return statistics.stdev(100 * (at[(arm, s)] - at[(reference, s)]) for s in seeds)

    study3 = sd("study3", "spo_tree_cutpoint", "grpo_prob_mask"), sd("study3", "spo_tree_cutpoint", "grpo")
    assert study3 == (pytest.approx(19.66, abs=0.01), pytest.approx(16.61, abs=0.01))
    assert [pairs_needed(d, s) for d in (10, 5) for s in study3] == [40, 29, 150, 108]
    study4 = sd("study4", "spo_tree", "grpo_prob_mask"), sd("study4", "spo_chain", "grpo_prob_mask")
    assert [pairs_needed(d, s) for d in (10, 5) for s in study4] == [29, 69, 107, 265]
    # The power straddles 0.8 at the answer (a Monte Carlo of 200,000 paired tests gave 0.797 and 0.808).
    assert paired_t_power(39, 10, study3[0]) < 0.8 <= paired_t_power(40, 10, study3[0])
