"""The gradient measurement's maths (spo_workbench.credit.gradient_measures) checked exactly: on hand-built vectors
(the cosine, the halves' correction, the paired interval), and on a tabular softmax policy whose every
response can be enumerated, so the true gradient of expected reward is known exactly:

* the sampled reference (leave-one-out baseline, sequence log-probability) is unbiased, its squared
  error falls as 1/n with the constant the enumeration predicts, and its cosine with the truth nears 1;
* GRPO's group-mean advantage without the standard-deviation normalisation, scaled by n / (n - 1), is
  unbiased (its mean over many draws is the true gradient within its sampling error);
* the correction of a cosine for the reference's noise recovers the cosine with the true gradient, where
  the raw cosine falls short of it.
"""

import itertools
import math
import os
import statistics
from pathlib import Path

import pytest
import torch

from spo_workbench.credit.gradient_measures import (corrected_cosine, cosine, draw_alignment, halves_reliability,
                                            leave_one_out_weights, reference_gradient, reference_objective,
                                            tokens_to_match)
from spo_workbench.student_t import paired_interval


def test_leave_one_out_weights_subtract_the_mean_of_the_other_rewards():
    weights = leave_one_out_weights(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert weights.tolist() == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out_weights(torch.tensor([1.0]))


def test_cosine_and_the_halves_correction_on_hand_built_vectors():
    # Truth g, two halves with orthogonal noise of equal norm, an estimator x at 45 degrees to g whose
    # own deviation is orthogonal to everything else: every quantity of the derivation is exact here.
    g = torch.tensor([2.0, 0, 0, 0, 0])
    half_a, half_b = g + torch.tensor([0, 2.0, 0, 0, 0]), g + torch.tensor([0, 0, 2.0, 0, 0])
    x = torch.tensor([1.0, 0, 0, 0, 1.0])
    rho = cosine(half_a, half_b)
    assert rho == pytest.approx(0.5)  # |g|^2 / (|g|^2 + s) = 4 / 8
    assert halves_reliability(rho) == pytest.approx(2 / 3)  # |g|^2 / (|g|^2 + s / 2) = 4 / 6
    raw = cosine(x, (half_a + half_b) / 2)
    assert raw == pytest.approx(1 / math.sqrt(3))  # 2 / (sqrt(2) sqrt(6))
    assert corrected_cosine(raw, rho) == pytest.approx(cosine(x, g)) == pytest.approx(1 / math.sqrt(2))
    # Halves that do not agree leave nothing to correct by; a zero vector has no direction.
    assert math.isnan(corrected_cosine(0.3, 0.0)) and math.isnan(corrected_cosine(0.3, -0.1))
    assert math.isnan(cosine(torch.zeros(3), torch.ones(3)))


def test_a_zero_update_counts_0_and_a_prompt_without_a_reference_direction_counts_nothing():
    assert draw_alignment(0.5, 1 / 3) == pytest.approx(0.5 / math.sqrt(0.5))  # corrected, as declared
    assert draw_alignment(math.nan, 0.5) == 0.0  # every reward agreed: no update, no progress
    assert draw_alignment(0.5, 0.0) is None and draw_alignment(math.nan, -0.2) is None


def test_the_paired_interval_over_prompts():
    result = paired_interval([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, sd sqrt(5/3), se sd / 2, t(0.975, 3) = 3.182446
    assert (result.n, result.mean, result.se) == (4, 2.5, pytest.approx(math.sqrt(5 / 3) / 2))
    assert (result.low, result.high) == (pytest.approx(2.5 - 3.182446 * 0.645497, abs=1e-5),
                                         pytest.approx(2.5 + 3.182446 * 0.645497, abs=1e-5))
    assert result.verdict == "better"
    # The smallest difference found with 80 % power: (t(0.975, 3) + t(0.8, 3)) se, t(0.8, 3) = 0.978472.
    assert result.detectable == pytest.approx((3.182446 + 0.978472) * 0.645497, abs=1e-5)
    assert paired_interval([-1.0, 1.0, 0.5]).verdict == "not resolved"
    assert paired_interval([-3.0, -2.0, -2.5]).verdict == "worse"
    assert paired_interval([0.2], unit="prompts").verdict == "not resolved (too few prompts)"
    assert (paired_interval([]).n, paired_interval([]).mean, paired_interval([0.2]).mean) == (0, None, 0.2)


def test_tokens_to_match_interpolates_in_log_tokens():
    points = [(1500, 0.1), (3000, 0.2), (6000, 0.4)]
    assert tokens_to_match(points, 0.3) == pytest.approx(math.sqrt(3000 * 6000))
    assert tokens_to_match(points, 0.05) == 1500 and tokens_to_match(points, 0.5) is None


def test_the_tokens_each_estimator_needs_to_match_grpo_at_its_largest_budget(tmp_path):
    """From a kept draws.csv (``--from-draws``) through summary.csv to matching.csv and the plot: GRPO's
    mean corrected cosine at 200 tokens is 0.4; the tree reaches it halfway between its 100 and 200 tokens
    in log tokens (sqrt(100 x 200)); the chain never does, and one of its draws is a zero update."""
    import csv

    from spo_workbench.credit import gradients

    columns = ["kind", "policy", "prompt_set", "parameters", "estimator", "budget", "draw", "prompt_uid", "tokens",
               "cosine", "halves_cosine", "corrected_cosine", "sample_seconds", "gradient_seconds"]
    cosines = {"grpo": (0.2, 0.4), "spo_tree_2_2": (0.3, 0.5), "spo_chain": (0.1, 0.2)}
    draws = tmp_path / "draws.csv"
    with open(draws, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for estimator, (low, high) in cosines.items():
            for budget, value in ((100, low), (200, high)):
                for uid, offset in (("a", -0.05), ("b", 0.05)):  # the prompts' mean is the value
                    # halves that agree perfectly: the corrected cosine is the cosine
                    writer.writerow(["draw", "base", "steps3", "last_blocks", estimator, budget, 0, uid, budget,
                                     value + offset, 1.0, value + offset, 1.0, 1.0])
        # A second draw of the chain on prompt a whose update is zero (every reward agreed: no cosine).
        writer.writerow(["draw", "base", "steps3", "last_blocks", "spo_chain", 100, 1, "a", 100, "nan", 1.0, "nan", 1.0, 1.0])
    assert gradients.main(["--from-draws", str(draws), "--output-dir", str(tmp_path)]) == 0
    with open(tmp_path / "summary.csv", newline="") as handle:
        summary = list(csv.DictReader(handle))
    tree_at_200 = next(r for r in summary if (r["prompt_set"], r["estimator"], r["budget"]) == ("all", "spo_tree_2_2", "200"))
    # Both prompts are 0.1 above GRPO's: a difference with no spread, so the smallest detectable one is 0.
    assert (float(tree_at_200["minus_grpo"]), float(tree_at_200["detectable"])) == (pytest.approx(0.1), pytest.approx(0.0, abs=1e-9))
    chain_at_100 = next(r for r in summary if (r["prompt_set"], r["estimator"], r["budget"]) == ("all", "spo_chain", "100"))
    # Prompt a's draws (0.05 and the zero update, 0) average 0.025; prompt b's is 0.15; the mean 0.0875.
    assert (chain_at_100["draws"], chain_at_100["zero_updates"]) == ("3", "1")
    assert float(chain_at_100["corrected_cosine"]) == pytest.approx(0.0875)
    # The same rows as the Markdown table RESULTS.md quotes; GRPO itself has no difference from itself.
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(summary)
    assert "| base | all | spo_tree_2_2 | 200 | 2 | 2 (0) | 200 | 0.500 | +0.100 [+0.100, +0.100] | 0.000 | better |" in table
    # Differences -0.125 and -0.1 from GRPO: se 0.0125, t(0.975, 1) = 12.706, t(0.8, 1) = 1.376.
    assert ("| base | all | spo_chain | 100 | 2 | 3 (1) | 100 | 0.088 | -0.113 [-0.271, +0.046] | 0.176 | "
            "not resolved |") in table
    assert "| base | all | grpo | 100 | 2 | 2 (0) | 100 | 0.200 | - | - | - |" in table
    assert (tmp_path / "cosine_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "matching.csv", newline="") as handle:
        matching = list(csv.DictReader(handle))
    found = {(r["prompt_set"], r["estimator"]): r for r in matching}
    assert set(found) == {(s, e) for s in ("steps3", "all") for e in ("spo_tree_2_2", "spo_chain")}
    tree, chain = found[("steps3", "spo_tree_2_2")], found[("steps3", "spo_chain")]
    assert (tree["grpo_budget"], float(tree["grpo_corrected_cosine"])) == ("200", pytest.approx(0.4))
    assert float(tree["tokens_to_match"]) == pytest.approx(math.sqrt(100 * 200), abs=0.05)
    assert chain["tokens_to_match"] == ""
    assert [r["tokens_to_match"] for r in matching if r["prompt_set"] == "steps3"] == ["", "141.4"]


_COMMITTED = sorted(path.parent for path in (Path(__file__).parents[1] / "docs/results/gradients").glob("*/summary.csv"))


def test_every_committed_gradient_result_has_its_draws():
    assert "base" in {folder.name for folder in _COMMITTED}
    assert all((folder / "draws.csv").is_file() for folder in _COMMITTED)


@pytest.mark.parametrize("folder", _COMMITTED, ids=lambda folder: folder.name)
def test_a_committed_gradient_result_recomputes_from_its_draws(folder, tmp_path):
    """What RESULTS.md quotes is what ``--from-draws`` writes from the committed draws.csv today: every
    table committed beside it, byte for byte."""
    from spo_workbench.credit import gradients

    gradients.summarise(folder / "draws.csv", tmp_path)
    written = sorted(path.name for path in tmp_path.iterdir() if path.suffix in (".csv", ".md"))
    committed = [name for name in written if (folder / name).is_file()]
    assert {"summary.csv", "table.md", "cost.csv"} <= set(committed)
    for name in committed:
        assert (tmp_path / name).read_text() == (folder / name).read_text(), name


def _kept_draws(path, draws):
    """A draws.csv of ``(prompt_uid, estimator, cosine[, draw])`` rows: base policy, `steps4`, 6,000 tokens,
    halves that agree perfectly (so the corrected cosine is the cosine)."""
    import csv

    columns = ["kind", "policy", "prompt_set", "parameters", "estimator", "budget", "draw", "prompt_uid", "tokens",
               "cosine", "halves_cosine", "corrected_cosine", "sample_seconds", "gradient_seconds"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for uid, estimator, value, *draw in draws:
            writer.writerow(["draw", "base", "steps4", "last_blocks", estimator, 6000, draw[0] if draw else 0, uid, 6000,
                             value, 1.0, value, 1.0, 1.0])
    return path


def test_each_prompts_share_of_the_summary(tmp_path):
    """prompts.csv: each prompt's mean corrected cosine (a zero update counting 0) and its difference from
    GRPO on that prompt; their mean over prompts is the summary's figure."""
    import csv

    from spo_workbench.credit import gradients

    draws = _kept_draws(tmp_path / "draws.csv", [
        ("a", "grpo", 0.8), ("a", "spo_tree_6_6_6", 0.5), ("a", "spo_tree_6_6_6", "nan", 1),
        ("b", "grpo", 0.6), ("b", "grpo", 0.4, 1), ("b", "spo_tree_6_6_6", 0.7)])
    assert gradients.main(["--from-draws", str(draws), "--output-dir", str(tmp_path)]) == 0
    with open(tmp_path / "prompts.csv", newline="") as handle:
        rows = {(r["estimator"], r["prompt_uid"]): r for r in csv.DictReader(handle)}
    assert sorted(rows) == [("grpo", "a"), ("grpo", "b"), ("spo_tree_6_6_6", "a"), ("spo_tree_6_6_6", "b")]
    assert {k: r["prompt_set"] for k, r in rows.items()} == dict.fromkeys(rows, "steps4")
    tree_a, tree_b = rows["spo_tree_6_6_6", "a"], rows["spo_tree_6_6_6", "b"]
    assert (tree_a["draws"], tree_a["zero_updates"], float(tree_a["corrected_cosine"])) == ("2", "1", 0.25)
    assert float(tree_a["minus_grpo"]) == pytest.approx(-0.55) and float(tree_b["minus_grpo"]) == pytest.approx(0.2)
    assert rows["grpo", "b"]["minus_grpo"] == "" and float(rows["grpo", "b"]["corrected_cosine"]) == 0.5
    with open(tmp_path / "summary.csv", newline="") as handle:
        summary = {(r["prompt_set"], r["estimator"]): r for r in csv.DictReader(handle)}
    assert float(summary["all", "spo_tree_6_6_6"]["minus_grpo"]) == pytest.approx((-0.55 + 0.2) / 2)


def test_each_tree_with_pooled_values_against_its_own_values_on_the_same_draws(tmp_path):
    """pooled.csv from a kept draws.csv: on three prompts the pooled tree's corrected cosine is 0.1, 0.2 and
    0.3 above the tree's own (one of its own draws a zero update, counting 0); a pooled tree without its
    own counterpart, and GRPO, get no row."""
    import csv

    from spo_workbench.credit import gradients

    kept = [(uid, estimator, value) for uid, own, pooled in (("a", 0.2, 0.3), ("b", 0.1, 0.3), ("c", 0.4, 0.7))
            for estimator, value in (("grpo", 0.5), ("spo_tree_6_6_6", own), ("spo_tree_6_6_6_pooled", pooled),
                                     ("spo_tree_2_2_pooled", 0.9))]
    # Prompt c's second draw: the tree's own update is zero (0), the pooled one 0.7; c's means 0.2 and 0.7.
    kept += [("c", "spo_tree_6_6_6", "nan", 1), ("c", "spo_tree_6_6_6_pooled", 0.7, 1)]
    draws = _kept_draws(tmp_path / "draws.csv", kept)
    assert gradients.main(["--from-draws", str(draws), "--output-dir", str(tmp_path)]) == 0
    with open(tmp_path / "pooled.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["prompt_set"], r["tree"], r["budget"], r["prompts"]) for r in rows] == [
        ("all", "spo_tree_6_6_6", "6000", "3"), ("steps4", "spo_tree_6_6_6", "6000", "3")]
    # Differences 0.1, 0.2, 0.5: mean 0.2667, sd 0.2082, se 0.1202, t(0.975, 2) = 4.302653.
    row = rows[0]
    assert float(row["pooled_minus_own"]) == pytest.approx(0.8 / 3, abs=1e-4)
    assert float(row["se"]) == pytest.approx(math.sqrt(0.13 / 3 / 3), abs=1e-4)
    assert (float(row["low"]), float(row["high"])) == (pytest.approx(0.8 / 3 - 4.302653 * math.sqrt(0.13 / 9), abs=1e-3),
                                                       pytest.approx(0.8 / 3 + 4.302653 * math.sqrt(0.13 / 9), abs=1e-3))
    assert row["verdict"] == "not resolved"


def test_each_tree_under_another_segment_weighting_against_the_papers_on_the_same_draws(tmp_path):
    """weights.csv: the 6-6-6 tree under ``paths`` and ``sqrt_paths`` minus the tree as the paper weighs
    it, paired over two prompts; the pooled tree and GRPO get no row there."""
    import csv

    from spo_workbench.credit import gradients

    draws = _kept_draws(tmp_path / "draws.csv", [
        (uid, estimator, value) for uid, own, paths, root in (("a", 0.2, 0.5, 0.3), ("b", 0.4, 0.9, 0.5))
        for estimator, value in (("grpo", 0.8), ("spo_tree_6_6_6", own), ("spo_tree_6_6_6_paths", paths),
                                 ("spo_tree_6_6_6_sqrt_paths", root), ("spo_tree_6_6_6_pooled", 0.1))])
    assert gradients.main(["--from-draws", str(draws), "--output-dir", str(tmp_path)]) == 0
    with open(tmp_path / "weights.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["prompt_set"] == "all"]
    assert [(r["tree"], r["variant"], r["prompts"]) for r in rows] == [("spo_tree_6_6_6", "paths", "2"),
                                                                      ("spo_tree_6_6_6", "sqrt_paths", "2")]
    # paths: differences 0.3 and 0.5 (mean 0.4, se 0.1, t(0.975, 1) = 12.7062); sqrt_paths: 0.1 and 0.1.
    assert float(rows[0]["variant_minus_own"]) == pytest.approx(0.4, abs=1e-4)
    assert (float(rows[0]["low"]), float(rows[0]["high"])) == (pytest.approx(0.4 - 1.27062, abs=1e-3),
                                                               pytest.approx(0.4 + 1.27062, abs=1e-3))
    assert float(rows[1]["variant_minus_own"]) == pytest.approx(0.1, abs=1e-4) and float(rows[1]["se"]) == 0


def test_bias_figures_from_the_products_each_draw_keeps():
    """_bias_figures from a draw's kept products equals the same figures computed from the vectors: the
    cosine of the mean of the first m draws (corrected by the halves), the bias cosine from the pairs of
    distinct draws, the noise's share and the responses a draw is worth."""
    from spo_workbench.credit.gradients import _bias_figures

    generator = torch.Generator().manual_seed(0)
    draws = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    half_a, half_b = torch.randn(2, 7, generator=generator, dtype=torch.float64) + 1.0
    reference = (half_a + half_b) / 2
    figures = _bias_figures([float(g @ reference) for g in draws], [float(g @ g) for g in draws],
                            [float(g @ draws[:r].sum(0)) for r, g in enumerate(draws)], float(half_a @ half_a),
                            float(half_b @ half_b), float(half_a @ half_b), half_samples=16)
    rho = cosine(half_a, half_b)
    by_draws = [cosine(draws[: m + 1].sum(0), reference) / math.sqrt(halves_reliability(rho)) for m in range(4)]
    assert [float(c) for c in figures["cosine_of_mean_by_draws"].split()] == pytest.approx(by_draws, rel=1e-3)
    assert figures["mean_cosine"] == pytest.approx(by_draws[-1], rel=1e-12)
    pairs = statistics.fmean(float(draws[r] @ draws[s]) for r in range(4) for s in range(r))
    assert pairs > 0
    expected_bias = statistics.fmean(float(g @ reference) for g in draws) / math.sqrt(pairs * float(half_a @ half_b))
    assert figures["bias_cosine"] == pytest.approx(expected_bias, rel=1e-12)
    mean_sq = statistics.fmean(float(g @ g) for g in draws)
    assert figures["noise_share"] == pytest.approx((mean_sq - pairs) / mean_sq, rel=1e-12)
    response_noise = 16 * float((half_a - half_b) @ (half_a - half_b)) / 2
    assert figures["effective_responses"] == pytest.approx(pairs / (mean_sq - pairs) * response_noise
                                                           / float(half_a @ half_b), rel=1e-12)


def test_the_bias_cosine_sees_through_the_noise_and_counts_responses():
    """Draws whose mean lies at cosine 0.6 to a true gradient, each buried in noise (one draw's cosine with
    the reference well below 0.6): the bias cosine recovers 0.6; unbiased draws as noisy as the mean of
    32 plain responses (the reference's halves the mean of 2,048 such) are worth about 32 responses.
    Over seeds 0-5 the figures spread 0.575-0.613 and 24-37 responses."""
    from spo_workbench.credit.gradients import _bias_figures

    generator = torch.Generator().manual_seed(1)
    dimension, response_sd = 400, 1.0
    truth = torch.randn(dimension, generator=generator, dtype=torch.float64)
    truth /= truth.norm()
    other = torch.randn(dimension, generator=generator, dtype=torch.float64)
    other -= (other @ truth) * truth
    other /= other.norm()
    noise = lambda n: torch.randn(dimension, generator=generator, dtype=torch.float64) * response_sd / math.sqrt(n)  # noqa: E731
    half_a, half_b = truth + noise(2048), truth + noise(2048)
    reference = (half_a + half_b) / 2

    def figures(mean, responses, draws=200):
        gradients = [mean + noise(responses) for _ in range(draws)]
        return _bias_figures([float(g @ reference) for g in gradients], [float(g @ g) for g in gradients],
                             [float(g @ sum(gradients[:r], torch.zeros(dimension, dtype=torch.float64)))
                              for r, g in enumerate(gradients)], float(half_a @ half_a), float(half_b @ half_b),
                             float(half_a @ half_b), half_samples=2048), gradients

    biased, gradients = figures(0.6 * truth + 0.8 * other, responses=16)
    assert statistics.fmean(corrected_cosine(cosine(g, reference), cosine(half_a, half_b)) for g in gradients) < 0.3
    assert biased["bias_cosine"] == pytest.approx(0.6, abs=0.05)
    unbiased, _ = figures(truth, responses=32)
    assert unbiased["bias_cosine"] == pytest.approx(1.0, abs=0.05)
    assert unbiased["effective_responses"] == pytest.approx(32, rel=0.25)


def test_the_bias_summary_pairs_prompts_where_both_bias_cosines_are_estimable():
    """bias_summary_rows over three prompts: the tree's bias cosine is not estimable on prompt c (nan), so
    its mean and median are over a and b, and its differences from GRPO and from its `paths` variant are
    paired over a and b; GRPO has no difference from itself, nor a tree of its own."""
    from spo_workbench.credit.gradients import bias_summary_rows

    def row(uid, estimator, bias, noise=0.5, responses=10.0):
        return {"policy": "base", "parameters": "last_blocks", "estimator": estimator, "budget": 6000,
                "prompt_set": "steps3", "prompt_uid": uid, "bias_cosine": bias, "mean_cosine": 0.5,
                "noise_share": noise, "effective_responses": responses}

    bias = [row(uid, estimator, value) for estimator, values in (
        ("grpo", (1.0, 0.9, 1.1)), ("spo_tree_6_6_6", (0.6, 0.5, math.nan)),
        ("spo_tree_6_6_6_paths", (0.9, 1.1, 4.0))) for uid, value in zip("abc", values)]
    rows = {r["estimator"]: r for r in bias_summary_rows(bias)}
    grpo, tree, paths = rows["grpo"], rows["spo_tree_6_6_6"], rows["spo_tree_6_6_6_paths"]
    assert "bias_minus_grpo" not in grpo and "bias_minus_tree" not in grpo and "bias_minus_tree" not in tree
    assert (tree["prompts"], tree["prompts_with_bias"]) == (3, 2)
    assert (tree["bias_cosine"], tree["bias_cosine_median"]) == (pytest.approx(0.55), pytest.approx(0.55))
    # paths: mean 2.0 of 0.9, 1.1 and 4.0, pulled up by prompt c; the median 1.1 is not.
    assert (paths["bias_cosine"], paths["bias_cosine_median"]) == (pytest.approx(2.0), pytest.approx(1.1))
    # Tree minus GRPO on a and b: -0.4 and -0.4 (no spread); paths minus the tree on a and b: 0.3 and 0.6,
    # mean 0.45, se 0.15, t(0.975, 1) = 12.7062.
    assert (tree["bias_minus_grpo"], tree["bias_minus_grpo_low"]) == (pytest.approx(-0.4), pytest.approx(-0.4))
    assert (paths["bias_minus_tree"], paths["bias_minus_tree_low"], paths["bias_minus_tree_high"]) == (
        pytest.approx(0.45), pytest.approx(0.45 - 12.7062 * 0.15, abs=1e-4), pytest.approx(0.45 + 12.7062 * 0.15, abs=1e-4))
    # paths minus GRPO over all three prompts: -0.1, 0.2, 2.9.
    assert paths["bias_minus_grpo"] == pytest.approx(1.0)


def test_the_averaging_curve_is_each_m_draws_tokens_and_their_means_cosine_over_prompts():
    """averaging_curves: m draws' tokens (m times the mean tokens a draw) against the mean over prompts of
    the cosine of the mean of each prompt's first m draws, over the prompts where it is defined: prompt b
    has two draws only, and prompt c's first draw was a zero update (its mean has no direction)."""
    from spo_workbench.credit.gradients import averaging_curves

    def row(uid, estimator, tokens, curve):
        return {"policy": "base", "parameters": "last_blocks", "estimator": estimator, "prompt_uid": uid,
                "tokens": tokens, "cosine_of_mean_by_draws": curve}

    curves = averaging_curves([row("a", "spo_tree_6_6_6_paths", 5000, "0.5 0.7 0.9"),
                               row("b", "spo_tree_6_6_6_paths", 6000, "0.3 0.5"),
                               row("c", "spo_tree_6_6_6_paths", 7000, "nan 0.6 0.7"),
                               row("a", "grpo", 6000, "0.8 0.9")])
    assert curves[("base", "last_blocks", "spo_tree_6_6_6_paths")] == [
        (6000, pytest.approx(0.4), 2), (12000, pytest.approx(0.6), 3), (18000, pytest.approx(0.8), 2)]
    assert curves[("base", "last_blocks", "grpo")] == [(6000, 0.8, 1), (12000, 0.9, 1)]


def test_the_recorded_machine_time_counts_a_shared_rollout_once(tmp_path):
    """A reference (10 s sampling, 20 s gradients), one rollout shared by two estimators (5 s, its time on
    both rows; gradients 1 s and 2 s), and another estimator's own rollout (7 s, gradient 3 s)."""
    import csv

    from spo_workbench.credit import gradients

    columns = ["kind", "policy", "prompt_set", "prompt_uid", "estimator", "budget", "draw", "tokens",
               "sample_seconds", "gradient_seconds"]
    rows = [["reference", "base", "steps3", "c1", "reference", "", "", "512", "10", "20"],
            ["draw", "base", "steps3", "c1", "grpo", "6000", "0", "6100", "5", "1"],
            ["draw", "base", "steps3", "c1", "grpo_prob_mask", "6000", "0", "6100", "5", "2"],
            ["draw", "base", "steps3", "c1", "spo_tree_6_6_6", "6000", "0", "5200", "7", "3"]]
    draws = tmp_path / "draws.csv"
    with open(draws, "w", newline="") as handle:
        csv.writer(handle).writerows([columns, *rows])
    cost = {row["prompt_set"]: row for row in gradients.cost_rows(draws)}
    assert set(cost) == {"steps3", "all"}
    assert {k: cost["all"][k] for k in ("reference_seconds", "draw_sample_seconds", "draw_gradient_seconds")} == {
        "reference_seconds": 30.0, "draw_sample_seconds": 12.0, "draw_gradient_seconds": 6.0}
    assert cost["steps3"]["machine_hours"] == pytest.approx(48 / 3600)


class TabularPolicy:
    """A softmax policy over 3 words and an end token, one table row per prefix of at most 2 words, that
    writes at most 3 tokens: 40 responses, each enumerated with its probability and the gradient of its
    log-probability. Reward 1 when the words sum to 3 or more (about 0.21 under the seed's table)."""

    VOCAB, EOS, HORIZON = 4, 3, 3

    def __init__(self, seed: int = 0):
        words = [w for w in range(self.VOCAB) if w != self.EOS]
        prefixes = [()] + [p for n in range(1, self.HORIZON) for p in itertools.product(words, repeat=n)]
        row = {p: i for i, p in enumerate(prefixes)}
        self.responses = []
        for length in range(1, self.HORIZON + 1):
            for body in itertools.product(words, repeat=length - 1):
                self.responses.append(body + (self.EOS,))
                if length == self.HORIZON:
                    self.responses += [body + (w,) for w in words]
        self.rewards = torch.tensor([float(sum(t for t in y if t != self.EOS) >= 3) for y in self.responses],
                                    dtype=torch.float64)
        generator = torch.Generator().manual_seed(seed)
        self.table = (0.5 * torch.randn(len(prefixes), self.VOCAB, generator=generator, dtype=torch.float64))
        self.table.requires_grad_(True)
        pad = lambda y, fill: list(y) + [fill] * (self.HORIZON - len(y))  # noqa: E731
        self._rows = torch.tensor([pad([row[y[:t]] for t in range(len(y))], 0) for y in self.responses])
        self._tokens = torch.tensor([pad(y, 0) for y in self.responses])
        self._mask = torch.tensor([pad([1.0] * len(y), 0.0) for y in self.responses], dtype=torch.float64)
        log_probs = self.log_probs(torch.arange(len(self.responses)))
        self.gradients = torch.stack([torch.autograd.grad(log_probs[i], self.table, retain_graph=True)[0].reshape(-1)
                                      for i in range(len(self.responses))])
        self.probabilities = log_probs.exp().detach()

    def log_probs(self, responses: torch.Tensor) -> torch.Tensor:
        """Sequence log-probabilities of the responses at these indices, differentiable in the table."""
        per_token = torch.log_softmax(self.table, dim=-1)[self._rows[responses], self._tokens[responses]]
        return (per_token * self._mask[responses]).sum(dim=-1)

    def exact_gradient(self) -> torch.Tensor:
        """grad of sum_y p(y) r(y), by autograd over the enumeration."""
        expected = (self.log_probs(torch.arange(len(self.responses))).exp() * self.rewards).sum()
        return torch.autograd.grad(expected, self.table)[0].reshape(-1)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.multinomial(self.probabilities, n, replacement=True, generator=generator)


@pytest.fixture(scope="module")
def policy():
    return TabularPolicy()


def test_the_enumeration_is_a_distribution_and_its_gradient_is_the_score_function_identity(policy):
    assert len(policy.responses) == 40 and float(policy.probabilities.sum()) == pytest.approx(1.0)
    # grad E[r] = sum_y p(y) r(y) grad log p(y): the identity every sampled estimate rests on.
    identity = (policy.probabilities * policy.rewards) @ policy.gradients
    assert torch.allclose(policy.exact_gradient(), identity, atol=1e-12)


def test_the_reference_objectives_backward_is_the_weighted_sum_of_per_response_gradients(policy):
    responses = policy.sample(16, torch.Generator().manual_seed(3))
    by_backward = torch.autograd.grad(reference_objective(policy.log_probs(responses), policy.rewards[responses]),
                                      policy.table)[0].reshape(-1)
    assert torch.allclose(by_backward, reference_gradient(policy.gradients[responses], policy.rewards[responses]),
                          atol=1e-12)


def test_the_sampled_reference_converges_to_the_exact_gradient(policy):
    exact = policy.exact_gradient()
    generator = torch.Generator().manual_seed(1)

    def reference(n):
        responses = policy.sample(n, generator)
        return reference_gradient(policy.gradients[responses], policy.rewards[responses])

    # At a fixed seed: 64 samples point within 15 degrees of the truth (cos 0.969), 4,096 within 3 (0.9987).
    assert 0.96 < cosine(reference(64), exact) < cosine(reference(4096), exact)
    assert cosine(reference(4096), exact) > 0.998
    # Its squared error falls as 1/n with the constant the enumeration gives: the variance of one
    # sample's (r - mu) grad log p (the leave-one-out baseline's extra variance is O(1/n^2)).
    mean_reward = float(policy.probabilities @ policy.rewards)
    per_sample = (float((policy.probabilities * (policy.rewards - mean_reward) ** 2) @ policy.gradients.pow(2).sum(1))
                  - float(exact.pow(2).sum()))
    for n in (64, 256):
        errors = [float((reference(n) - exact).pow(2).sum()) for _ in range(1000)]
        # 1,000 repetitions: the mean squared error within 10 % of per_sample / n (0.1 % and 2.5 % off here).
        assert statistics.fmean(errors) == pytest.approx(per_sample / n, rel=0.10)


def _within_sampling_error(draws: torch.Tensor, exact: torch.Tensor, z: float = 4.5) -> None:
    """Every coordinate of the draws' mean within z standard errors of the exact gradient (4.5: 52
    coordinates at a familywise error far below 1e-3); coordinates no draw moves are exactly 0 in both."""
    mean, se = draws.mean(dim=0), draws.std(dim=0) / math.sqrt(len(draws))
    moved = se > 0
    assert torch.all(exact[~moved].abs() < 1e-12)
    assert float(((mean - exact)[moved] / se[moved]).abs().max()) < z


def test_unbiased_estimators_mean_gradient_matches_the_exact_one(policy):
    exact = policy.exact_gradient()
    generator = torch.Generator().manual_seed(2)
    group = 4
    grpo_without_std, reference_of_a_group = [], []
    for _ in range(20000):
        responses = policy.sample(group, generator)
        rewards = policy.rewards[responses]
        # GRPO without the std normalisation: r - the group's mean (itself included), so each weight is
        # (n - 1) / n of the leave-one-out one: unbiased once scaled back.
        advantages = rewards - rewards.mean()
        grpo_without_std.append(group / (group - 1) * (advantages[:, None] * policy.gradients[responses]).mean(dim=0))
        reference_of_a_group.append(reference_gradient(policy.gradients[responses], rewards))
    for draws in (torch.stack(grpo_without_std), torch.stack(reference_of_a_group)):
        _within_sampling_error(draws, exact)
        assert cosine(draws.mean(dim=0), exact) > 0.999
    # The two are the same estimator: (r_i - mean) n / (n - 1) = r_i - mean of the others.
    assert torch.allclose(torch.stack(grpo_without_std), torch.stack(reference_of_a_group), atol=1e-12)


def test_the_halves_correction_recovers_the_cosine_with_the_true_gradient(policy):
    """A GRPO draw of 4 responses against a noisy reference (two halves of 32): over 2,000 draws the raw
    cosine falls short of the cosine with the exact gradient, the corrected one recovers it."""
    exact = policy.exact_gradient()
    generator = torch.Generator().manual_seed(4)
    raw, corrected, true = [], [], []
    for _ in range(2000):
        responses = policy.sample(4, generator)
        rewards = policy.rewards[responses]
        draw = ((rewards - rewards.mean())[:, None] * policy.gradients[responses]).mean(dim=0)
        halves = []
        for _ in range(2):
            sample = policy.sample(32, generator)
            halves.append(reference_gradient(policy.gradients[sample], policy.rewards[sample]))
        rho = cosine(*halves)
        with_reference = cosine(draw, (halves[0] + halves[1]) / 2)
        fixed = corrected_cosine(with_reference, rho)
        if math.isnan(with_reference) or math.isnan(fixed):  # a group whose rewards agree trains nothing
            continue
        raw.append(with_reference), corrected.append(fixed), true.append(cosine(draw, exact))
    assert len(true) > 1000
    truth = statistics.fmean(true)  # about 0.53 at this seed
    assert statistics.fmean(raw) < truth - 0.03  # the reference's noise shrinks every cosine
    assert statistics.fmean(corrected) == pytest.approx(truth, abs=0.025)


@pytest.mark.asyncio(loop_scope="session")  # verl's server client lives in the session loop
async def test_the_quick_measurement_writes_every_draw_and_resumes(llm_client, cpu_tiny_cache, tmp_path, monkeypatch):
    """``python -m spo_workbench.credit.gradients --quick`` on the session's server (the cpu-tiny cache
    around the untrained tiny model, so a toy reward that varies: an even number of characters): every
    estimator's draws through the agent loops, verl's advantage step and policy loss, one row each with
    its cosine and corrected cosine; each prompt's reference row with its halves' cosine; started again,
    it samples nothing and keeps every row."""
    import csv

    from spo_verl.adapters.cpu_platform.environment import cpu_run_env
    from spo_workbench.credit import gradients
    from spo_workbench.credit.gradient_draws import sampling_key

    monkeypatch.setenv("SPO_CPU_CACHE", str(cpu_tiny_cache))
    for key, value in cpu_run_env().items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setattr(gradients, "SCORE", lambda text, truth: float(len(text) % 2 == 0))
    plan, prompt_set = gradients.quick_plan()
    output = tmp_path / "gradients"
    await gradients.measure(plan, prompt_set, output, client=llm_client)
    with open(output / "draws.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == gradients.COLUMNS
    references = [r for r in rows if r["kind"] == "reference"]
    assert sorted(r["prompt_uid"] for r in references) == ["c0", "c1"]  # no screening on the tiny model
    for r in references:
        assert int(r["units"]) == 32 and -1 <= float(r["halves_cosine"]) <= 1 and int(r["tokens"]) > 0
    draws = [r for r in rows if r["kind"] == "draw"]
    costs: dict[str, list[float]] = {}
    with open(output / "units-tiny-tiny_add.csv", newline="") as handle:
        for r in csv.DictReader(handle):
            costs.setdefault(r["sampling"], []).append(float(r["tokens"]))
    expected = set()
    for budget in plan.budgets:  # every estimator at every budget its unit fits, 2 prompts x 2 draws
        for estimator in plan.estimators:
            cost = statistics.fmean(costs[sampling_key(estimator)])
            if cost <= gradients.UNIT_OVER_BUDGET * budget:
                expected |= {(estimator.name, str(budget), uid, str(d)) for uid in ("c0", "c1") for d in range(2)}
                units = {int(r["units"]) for r in draws if (r["estimator"], r["budget"]) == (estimator.name, str(budget))}
                assert units == {max(1, round(budget / cost))}
    assert {(r["estimator"], r["budget"], r["prompt_uid"], r["draw"]) for r in draws} == expected
    # Estimators that share a sampling are computed on the same rollouts of a draw: GRPO with and without
    # the mask, the tree with and without pooled values.
    # the mask, the tree with pooled values and under each segment weighting: one rollout id for all.
    for first, *others in (("grpo", "grpo_prob_mask"),
                           ("spo_tree_2_2", "spo_tree_2_2_pooled", "spo_tree_2_2_paths", "spo_tree_2_2_sqrt_paths")):
        rollouts = {name: {(r["budget"], r["prompt_uid"], r["draw"]): (r["rollout"], r["tokens"], r["reward_mean"])
                           for r in draws if r["estimator"] == name} for name in (first, *others)}
        for other in others:
            assert rollouts[other] == rollouts[first] and rollouts[first]
    assert len({r["rollout"] for r in draws}) == len({(r["budget"], r["prompt_uid"], r["draw"], sampling_key(e))
                                                    for r in draws for e in plan.estimators if e.name == r["estimator"]})
    assert {e for e, *_ in expected} >= {"grpo", "grpo_prob_mask", "spo_tree_2_2", "spo_tree_2_2_paths"}
    # Each draw keeps its gradient's products: its second draw's product with the first is the kept files'.
    for r in references:
        rho = float(r["halves_dot"]) / math.sqrt(float(r["half_a_norm_sq"]) * float(r["half_b_norm_sq"]))
        assert rho == pytest.approx(float(r["halves_cosine"]), abs=1e-5)
    second = next(r for r in draws if r["draw"] == "1" and r["estimator"] == "spo_tree_2_2_paths")
    kept = [torch.load(output / "draw_gradients" / f"tiny-tiny_add-{second['prompt_uid']}-spo_tree_2_2_paths-b{second['budget']}-"
                       f"last_blocks-d{d}.pt").double() for d in (0, 1)]
    assert float(second["dot_earlier"]) == pytest.approx(float(kept[1] @ kept[0]), rel=1e-9, abs=1e-12)
    assert float(second["norm_sq"]) == pytest.approx(float(kept[1] @ kept[1]), rel=1e-9, abs=1e-12)
    finite = [r for r in draws if not math.isnan(float(r["cosine"]))]
    assert len(finite) >= len(draws) // 2  # a draw whose rewards all agree trains nothing: no direction
    for r in finite:
        assert -1 <= float(r["cosine"]) <= 1 and int(r["tokens"]) > 0
        rho = float(r["halves_cosine"])
        if rho > 0:  # the correction as declared
            assert float(r["corrected_cosine"]) == pytest.approx(float(r["cosine"]) / math.sqrt(2 * rho / (1 + rho)), rel=1e-4)
        else:  # halves that disagree say nothing of the true gradient's direction: no corrected cosine
            assert not r["corrected_cosine"] or math.isnan(float(r["corrected_cosine"]))
    # Started again: every draw, reference and unit cost is kept, nothing is sampled again.
    calls = []
    monkeypatch.setattr(gradients, "SCORE", lambda text, truth: calls.append(text) or 0.0)
    await gradients.measure(plan, prompt_set, output, client=llm_client)
    with open(output / "draws.csv", newline="") as handle:
        assert list(csv.DictReader(handle)) == rows
    assert calls == []
    summary = gradients.summarise(output / "draws.csv", output)  # what --from-draws writes
    assert (output / "cosine_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"
    assert (output / "cosine_of_mean_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"  # each draw keeps its products
    assert len((output / "table.md").read_text().splitlines()) == 2 + len(summary)
    with open(output / "cost.csv", newline="") as handle:
        recorded = {r["prompt_set"]: float(r["machine_hours"]) for r in csv.DictReader(handle)}
    assert recorded["all"] == pytest.approx(recorded[prompt_set.name]) and recorded["all"] > 0
    # The 2-2 tree with pooled values, or under another weighting, against its own, wherever the summary has it.
    with open(output / "pooled.csv", newline="") as handle:
        pooled = {(r["prompt_set"], r["tree"], int(r["budget"])) for r in csv.DictReader(handle)}
    assert pooled == {(r["prompt_set"], "spo_tree_2_2", r["budget"]) for r in summary
                      if r["estimator"] == "spo_tree_2_2_pooled"}
    with open(output / "weights.csv", newline="") as handle:
        weighted = {(r["prompt_set"], r["variant"], int(r["budget"])) for r in csv.DictReader(handle)}
    assert weighted == {(r["prompt_set"], r["estimator"].removeprefix("spo_tree_2_2_"), r["budget"]) for r in summary
                        if r["estimator"] in ("spo_tree_2_2_paths", "spo_tree_2_2_sqrt_paths")}
    # Bias figures for every estimator, budget and prompt with two draws and a reference.
    with open(output / "bias.csv", newline="") as handle:
        bias = {(r["estimator"], r["budget"], r["prompt_uid"]): r for r in csv.DictReader(handle)}
    assert set(bias) == {(e, b, u) for e, b, u, _ in expected}
    for row in bias.values():
        assert row["draws"] == "2" and len(row["cosine_of_mean_by_draws"].split()) == 2
    # Each (estimator, budget) is summarised over exactly the prompts whose halves agree: on the untrained
    # tiny model a prompt's halves may disagree (rho <= 0), and its draws then stay out of the summary. A
    # draw whose update is zero (no cosine) stays in, counted 0.
    measured: dict[tuple[str, int], set[str]] = {}
    zero: dict[tuple[str, int], int] = {}
    for r in draws:
        if float(r["halves_cosine"]) > 0:
            measured.setdefault((r["estimator"], int(r["budget"])), set()).add(r["prompt_uid"])
            zero[(r["estimator"], int(r["budget"]))] = zero.get((r["estimator"], int(r["budget"])), 0) + math.isnan(float(r["cosine"]))
    summarised = {(r["estimator"], r["budget"]): (r["prompts"], r["zero_updates"]) for r in summary if r["prompt_set"] == "all"}
    assert summarised == {key: (len(uids), zero[key]) for key, uids in measured.items()}
    assert set(summarised) <= {(e, int(b)) for e, b, *_ in expected}
    # --time-one-draw: the phases timed on the first candidate, no cosine anywhere.
    import dataclasses

    timed = await gradients.time_one_draw(dataclasses.replace(plan, screen_samples=4), prompt_set,
                                          tmp_path / "cost" / "cost.csv", client=llm_client)
    assert [r["phase"] for r in timed[:2]] == ["screen", "reference_half"] and timed[1]["rows"] == 16
    assert {r["estimator"] for r in timed if r["phase"] == "unit"} == {"group4", "tiny_2_2", "tiny_chain"}
    drawn = {r["estimator"] for r in timed if r["phase"] == "draw"}
    assert {"grpo", "grpo_prob_mask"} <= drawn and all(r["tokens"] >= 0 for r in timed)
    with open(tmp_path / "cost" / "cost.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    assert tuple(written[0]) == gradients.COST_COLUMNS and len(written) == len(timed)
    assert not (tmp_path / "cost" / "draws.csv").exists()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_grpo_draw_carries_verls_grpo_advantage(llm_client, cpu_tiny_cache, monkeypatch):
    """A GRPO draw as the measurement samples it (verl's single_turn_agent, its advantage step): each
    response's tokens all carry (r - mean) / (std + 1e-6) of its group of four (verl's default, the
    unbiased std), GRPO with one group over the draw's whole set; every token is trained."""
    from spo_verl.adapters.cpu_platform.environment import cpu_run_env
    from spo_workbench.credit import gradients
    from spo_workbench.credit.gradient_draws import Estimator, GroupSetup, sample_draw

    for key, value in cpu_run_env().items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setenv("SPO_CPU_CACHE", str(cpu_tiny_cache))
    plan, prompt_set = gradients.quick_plan()
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(plan.model_dir)
    uid, messages, truth = prompt_set.candidates[0]
    estimators = [Estimator("grpo", GroupSetup("grpo"), "grpo", "vanilla"),
                  Estimator("grpo_one_group", GroupSetup("grpo", one_group=True), "grpo", "vanilla")]
    # A reward that varies whatever the untrained model writes: every third response scored right (the
    # advantages are checked against the rewards the draw records, in whatever order they were scored).
    scored = itertools.count()
    draw = await sample_draw(estimators, 3, plan.model_dir, llm_client, tokenizer, f"{uid}/grpo", messages, truth,
                             prompt_set.prompt_length, prompt_set.response_length,
                             score=lambda text, _: float(next(scored) % 3 == 0))
    rewards = torch.tensor(draw.rewards)
    assert len(rewards) == 12 and 0 < float(rewards.sum()) < 12  # both kinds of answer

    def verl_grpo(group):
        return (group - group.mean()) / (group.std() + 1e-6)

    expected = {"grpo": torch.cat([verl_grpo(rewards[g: g + 4]) for g in range(0, 12, 4)]),
                "grpo_one_group": verl_grpo(rewards)}
    for name, advantages in expected.items():
        for row, advantage in zip(draw.rows[name], advantages.tolist()):
            assert row.advantages == pytest.approx([advantage] * len(row.response_ids), abs=1e-6)
            assert all(row.trained) and len(row.trained) == len(row.response_ids)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_prompt_whose_halves_agree_less_than_declared_is_kept_out(tiny_model, tmp_path, monkeypatch):
    """The declared minimum, 0.2, as it stands: of three candidates that pass the screen, the one whose
    reference's halves agree at 0.19 is kept out, those at exactly 0.2 and at 0.5 are kept. The halves'
    cosine is given (the sampler cannot be made to hit 0.19); the screening and the rule are the
    measurement's."""
    import csv
    import dataclasses

    from spo_workbench.credit import gradient_draws, gradients
    from spo_workbench.credit.rollouts import Leaf

    assert gradients.MIN_HALVES_COSINE == 0.2 and gradients.SCREEN_RIGHT == (2, 14)
    halves = {"c0": 0.19, "c1": 0.2, "c2": 0.5}

    async def screened(config, client, tokenizer, uid, messages, truth, score):
        return [Leaf(uid, None, float(i < 8)) for i in range(16)]  # 8 of 16 right: inside 2-14

    async def reference(self, uid, messages, truth):
        return halves[uid]

    monkeypatch.setattr(gradient_draws, "plain_samples", screened)
    monkeypatch.setattr(gradient_draws, "group_config", lambda *args: None)
    monkeypatch.setattr(gradients.Measurement, "reference", reference)
    plan = gradients.Plan([], [], draws=0, prompts=3, reference_samples=8, screen_samples=16, parameters="last_blocks",
                          policy="tiny", model_dir=tiny_model[0])
    prompt_set = gradients.tiny_prompt_set()
    prompt_set = dataclasses.replace(prompt_set, screen=True, candidates=prompt_set.candidates[:3])
    chosen = await gradients.Measurement(plan, prompt_set, tmp_path, None, None).choose_prompts()
    assert [uid for uid, _, _ in chosen] == ["c1", "c2"]
    with open(tmp_path / "prompts-tiny-tiny_add.csv", newline="") as handle:
        assert [(r["prompt_uid"], r["screen_right"], r["kept"]) for r in csv.DictReader(handle)] == [
            ("c0", "8", "0"), ("c1", "8", "1"), ("c2", "8", "1")]


def test_an_estimators_gradient_is_minus_the_policy_loss_gradient_pushed_through_the_model_in_chunks(tiny_model):
    """At ratio 1 verl's vanilla loss with token-mean is -sum(A * log p) / (response tokens) on the value
    side, so its ascent direction is sum(A grad log p) / tokens over the trained tokens; the chunked
    two-pass computation gives that, whatever the chunk, for every parameter or the last blocks only."""
    from transformers import AutoModelForCausalLM

    from spo_workbench.credit.gradient_draws import Row, _token_log_probs, estimator_gradient, trainable

    model = AutoModelForCausalLM.from_pretrained(tiny_model[0], torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for b in range(5):
        prompt = torch.randint(5, 60, (3 + b,), generator=generator).tolist()
        response = torch.randint(5, 60, (2 + 2 * b,), generator=generator).tolist()
        advantages = torch.randn(len(response), generator=generator).tolist()
        trained = [t % 3 != 1 for t in range(len(response))]  # a tree's row trains only some segments
        rows.append(Row(prompt, response, advantages, trained))
    for parameters in ("last_blocks", "all"):
        chosen = trainable(model, parameters)
        expected_objective = sum((lp * torch.tensor(r.advantages) * torch.tensor(r.trained, dtype=torch.float32)).sum()
                                 for lp, r in zip(_token_log_probs(model, rows), rows)) / sum(sum(r.trained) for r in rows)
        expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(expected_objective, chosen)])
        for chunk in (1, 2, 8):
            got = estimator_gradient(model, chosen, rows, "vanilla", chunk_rows=chunk)
            assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4), (parameters, chunk)
        if parameters == "last_blocks":
            assert len(expected) < sum(p.numel() for p in model.parameters())
    # The masked loss couples the rows (whitening over the batch's masked tokens): still chunk-independent.
    masked = [estimator_gradient(model, chosen, rows, "spo_prob_mask", chunk_rows=chunk) for chunk in (1, 8)]
    assert torch.allclose(masked[0], masked[1], atol=1e-6, rtol=1e-4) and float(masked[0].norm()) > 0


@pytest.mark.asyncio(loop_scope="session")
async def test_prompts_are_chosen_by_the_declared_rule_screen_then_a_reliable_reference(llm_client, cpu_tiny_cache,
                                                                                         tmp_path, monkeypatch):
    """The rule SmolLM2's prompts are chosen by, on the tiny model with a toy reward: candidates in order,
    each screened, kept only when its right screening samples lie in the declared range and its
    reference's halves agree at least as declared; every candidate looked at is a line of the prompts
    file, and started again the choice is read back, nothing sampled."""
    import csv
    import dataclasses

    from spo_verl.adapters.cpu_platform.environment import cpu_run_env
    from spo_workbench.credit import gradients

    monkeypatch.setenv("SPO_CPU_CACHE", str(cpu_tiny_cache))
    for key, value in cpu_run_env().items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setattr(gradients, "SCORE", lambda text, truth: float(len(text) % 2 == 0))
    monkeypatch.setattr(gradients, "SCREEN_RIGHT", (1, 3))  # of 4: both kinds of answer among the samples
    plan, prompt_set = gradients.quick_plan()
    plan = dataclasses.replace(plan, screen_samples=4, prompts=2, reference_samples=8)
    prompt_set = dataclasses.replace(prompt_set, screen=True)
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(plan.model_dir)

    # No reference reliable enough (a threshold no cosine reaches): the first candidates are all looked
    # at, each screened, and none is kept.
    monkeypatch.setattr(gradients, "MIN_HALVES_COSINE", 1.01)
    few = dataclasses.replace(prompt_set, candidates=prompt_set.candidates[:3])
    assert await gradients.Measurement(plan, few, tmp_path / "none", llm_client, tokenizer).choose_prompts() == []
    with open(tmp_path / "none" / "prompts-tiny-tiny_add.csv", newline="") as handle:
        assert [(r["prompt_uid"], r["kept"]) for r in csv.DictReader(handle)] == [("c0", "0"), ("c1", "0"), ("c2", "0")]

    # Every reference reliable that has a direction (halves whose rewards all agree have none): which
    # prompts are kept is the sampler's; that the rule reads them in order and stops at the second is the test.
    monkeypatch.setattr(gradients, "MIN_HALVES_COSINE", -1.0)
    measurement = gradients.Measurement(plan, prompt_set, tmp_path, llm_client, tokenizer)
    chosen = await measurement.choose_prompts()
    with open(tmp_path / "prompts-tiny-tiny_add.csv", newline="") as handle:
        looked_at = list(csv.DictReader(handle))
    assert [r["prompt_uid"] for r in looked_at] == [uid for uid, _, _ in prompt_set.candidates[: len(looked_at)]]
    for r in looked_at:
        passes = 1 <= int(r["screen_right"]) <= 3
        assert (r["halves_cosine"] != "") == passes  # a reference only for a candidate that passed the screen
        reliable = passes and float(r["halves_cosine"]) >= gradients.MIN_HALVES_COSINE
        assert int(r["kept"]) == int(reliable)
    assert [uid for uid, _, _ in chosen] == [r["prompt_uid"] for r in looked_at if r["kept"] == "1"]
    assert len(chosen) == 2 and looked_at[-1]["kept"] == "1"  # it stops at the second prompt kept
    monkeypatch.setattr(gradients, "SCORE", lambda text, truth: pytest.fail("sampled again"))
    assert await measurement.choose_prompts() == chosen


def test_rows_that_share_their_prompt_encode_it_once_and_get_the_per_row_gradient(tiny_model):
    """A draw's rows all repeat the prompt (a tree's also their shared segments): the prompt, less the
    token that predicts the first response token, is encoded once and its keys and values serve every
    chunk; the gradient is the one computed row by row, for every parameter or the last blocks only, and
    the log-probabilities are the rows' own."""
    from transformers import AutoModelForCausalLM

    from spo_workbench.credit.gradient_draws import (Row, _token_log_probs, estimator_gradient, shared_prefix,
                                                      trainable)

    model = AutoModelForCausalLM.from_pretrained(tiny_model[0], torch_dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 60, (9,), generator=generator).tolist()
    segment = torch.randint(5, 60, (3,), generator=generator).tolist()
    rows = []
    for b in range(6):  # siblings after one shared segment, then rows that part at the first response token
        head = segment if b < 3 else []
        response = head + torch.randint(5, 60, (1 + b,), generator=generator).tolist()
        rows.append(Row(prompt, response, torch.randn(len(response), generator=generator).tolist(),
                        [True] * len(response)))
    with torch.no_grad():
        prefix = shared_prefix(model, rows)
        assert prefix.ids == prompt[:-1]  # the last prompt token is each row's: it predicts the response
        assert shared_prefix(model, rows[:3]).ids == prompt[:-1]  # never past the prompt
        for shared, alone in zip(_token_log_probs(model, rows, prefix), _token_log_probs(model, rows)):
            assert torch.allclose(shared, alone, atol=1e-5)
    other = Row([prompt[0] + 1, *prompt[1:]], [7], [1.0], [True])
    assert shared_prefix(model, [*rows, other]) is None  # no token shared by every row
    for parameters in ("last_blocks", "all"):
        chosen = trainable(model, parameters)
        objective = sum((lp * torch.tensor(r.advantages)).sum() for lp, r in zip(_token_log_probs(model, rows), rows))
        expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(objective / sum(len(r.advantages) for r in rows),
                                                                          chosen)])
        for chunk in (1, 4):
            got = estimator_gradient(model, chosen, rows, "vanilla", chunk_rows=chunk)
            assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4), (parameters, chunk)
