"""python -m spo_workbench.report on small recorded runs: every plot, CSV and the HTML page are produced, the
numbers are the ones recorded, and the page rendered by a real headless browser (Debian's chromium)
is not blank and shows the segments and the tree it was given.

The runs are recorded here with the same code the training runs use: verl's own FileLogger for the
metrics and the sample log's functions (spo_verl.adapters.trainer.sample_log) for samples.jsonl, so neither
format can drift from what the report reads.

Chromium: the browser check skips when /usr/bin/chromium is missing on a developer machine, and fails
under CI (environment variable CI=true), where the browser is part of the set-up.
"""

import csv
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from spo_verl.adapters.advantage_channel import provide_spo_rows
from spo_verl.adapters.settings import spo_settings
from spo_verl.adapters.estimators import compute_spo_chain_advantage, compute_spo_tree_advantage
from spo_verl.adapters.trainer.batch_view import SampledResponse
from spo_verl.adapters.trainer.sample_log import SAMPLES_FILE, append_record, step_record

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ACCURACY = "val-core/openai/gsm8k/acc/mean@1"
PLOTS = ["accuracy_vs_step.png", "accuracy_vs_generated_tokens.png", "accuracy_vs_wall_time.png", "reward_vs_step.png",
         "reward_vs_generated_tokens.png", "reward_vs_wall_time.png", "blame_on_error_vs_generated_tokens.png",
         "blame_on_error_masked_vs_generated_tokens.png"]
OUTPUTS = [*PLOTS, "results.csv", "summary.csv", "groups.csv", "report.html"]


class WordTokenizer:
    """Token id i decodes to WORDS[i]: segment texts are readable and predictable."""

    WORDS = ["<p>", "What", " is", " 2+3", "?", "2", "+3", "=", "5", "6", " so", " ####", " 5", " 6", "<eos>", " ok"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.WORDS[int(i)] for i in ids)


def log_metrics(path, steps, monkeypatch):
    """Write a metrics file with verl's own file logger, as trainer.logger=[..., file] does."""
    from verl.utils.tracking import FileLogger

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    logger = FileLogger("spo", "test")
    for step, data in steps:
        logger.log(data=data, step=step)
    logger.finish()
    return path


def training_step(score, seconds, total, prompt_mean, response_mean, **extra):
    return {"critic/score/mean": score, "timing_s/step": seconds, "perf/total_num_tokens": total,
            "prompt_length/mean": prompt_mean, "response_length/mean": response_mean, "actor/pg_loss": 0.1, **extra}


def response(b, row, ids, advantages, trained, score, probs):
    return SampledResponse(batch_index=b, uid="q1", row=row, prompt_ids=[0, 1, 2, 3, 4], response_ids=ids,
                           log_probs=torch.tensor(probs).log(), response_mask=torch.ones(len(ids)),
                           advantages=advantages[: len(ids)], trained=trained[: len(ids)], score=score)


# A 2-2 tree: first segments "5" (node 1, wrong) and "2" "+3" (node 2); leaves end with "<eos>".
TREE_ROWS = [
    {"tree_id": "t9", "path": [1, 3], "segment_ends": [1, 4], "trains": True, "truncated": False},
    {"tree_id": "t9", "path": [1, 4], "segment_ends": [1, 3], "trains": True, "truncated": False},
    {"tree_id": "t9", "path": [2, 5], "segment_ends": [2, 5], "trains": True, "truncated": False},
    {"tree_id": "t9", "path": [2, 6], "segment_ends": [2, 5], "trains": True, "truncated": False},
]
TREE_IDS = [[8, 11, 12, 14], [8, 15, 14], [5, 6, 7, 8, 14], [5, 6, 7, 9, 14]]
TREE_SCORES = [1.0, 0.0, 1.0, 0.0]


def tree_record(step):
    width = max(len(ids) for ids in TREE_IDS)
    mask, rewards = torch.zeros(4, width), torch.zeros(4, width)
    for b, ids in enumerate(TREE_IDS):
        mask[b, : len(ids)] = 1
        rewards[b, len(ids) - 1] = TREE_SCORES[b]
    config = OmegaConf.create({"adv_estimator": "spo_tree", "spo": {}})
    with provide_spo_rows(TREE_ROWS) as context:
        advantages, _ = compute_spo_tree_advantage(rewards, mask, index=np.array(["q1"] * 4), config=config)
    trained = context.trained_mask & mask.bool()
    probs = [0.5, 0.97, 0.3, 0.99, 0.8]
    responses = [response(b, TREE_ROWS[b], ids, advantages[b], trained[b], TREE_SCORES[b], probs[: len(ids)])
                 for b, ids in enumerate(TREE_IDS)]
    return step_record(step, config.adv_estimator, "spo_prob_mask", responses, WordTokenizer(), spo_settings(config), tree_nodes=context.tree_nodes)


def chain_record(step):
    ids = [5, 6, 7, 8, 11, 12, 14]
    probs = [0.95, 0.4, 0.99, 0.3, 0.97, 0.99, 0.9]
    row = {"segment_starts": [1, 3], "boundary_values": [0.25, 0.75], "truncated": False}
    rewards = torch.zeros(1, len(ids))
    rewards[0, -1] = 1.0
    config = OmegaConf.create({"adv_estimator": "spo_chain", "spo": {}})
    with provide_spo_rows([row]):
        advantages, _ = compute_spo_chain_advantage(rewards, torch.ones(1, len(ids)), index=np.array(["q1"]), config=config)
    chosen = response(0, row, ids, advantages[0], torch.ones(len(ids), dtype=torch.bool), 1.0, probs)
    return step_record(step, config.adv_estimator, "spo_prob_mask", [chosen], WordTokenizer(), spo_settings(config))


def grpo_record(step):
    ids = [5, 6, 7, 9, 14]
    config = OmegaConf.create({"adv_estimator": "grpo", "spo": {}})
    chosen = response(0, None, ids, torch.full((5,), -0.7), torch.ones(5, dtype=torch.bool), 0.0, [0.6, 0.95, 0.99, 0.5, 0.9])
    return step_record(step, config.adv_estimator, "spo_prob_mask", [chosen], WordTokenizer(), spo_settings(config))


@pytest.fixture(scope="module")
def recorded_runs(tmp_path_factory):
    """Three recorded runs (spo_tree, spo_chain, grpo_prob_mask) of 4 steps, validated at 0, 2 and 4."""
    root = tmp_path_factory.mktemp("runs")
    monkeypatch = pytest.MonkeyPatch()
    runs = {}
    tree_steps = [(0, {ACCURACY: 0.10})]
    chain_steps = [(0, {ACCURACY: 0.10})]
    grpo_steps = [(0, {ACCURACY: 0.10})]
    for step in range(1, 5):
        validation = {ACCURACY: 0.1 + 0.1 * step} if step % 2 == 0 else {}
        tree_steps.append((step, training_step(0.3 + 0.1 * step, 10.0, 900, 10.0, 5.0,
                                               **{"spo/tree/generated_tokens": 100.0 + step, **validation,
                                                  "spo/credit/blame_on_error": 0.1 * step, "spo/credit/blame_on_error_masked": 0.2,
                                                  "spo/trained_tokens": 40.0 + step,
                                                  "spo/packing/packed_tokens": 150.0 + step, "spo/packing/row_tokens": 450.0,
                                                  "timing_s/gen": 4.0, "timing_s/update_actor": 3.0,
                                                  **({"timing_s/testing": 1.5} if validation else {})})))
        chain_steps.append((step, training_step(0.25 + 0.1 * step, 20.0, 1000, 10.0, 15.0,
                                                **{"spo/chain/mc_tokens": 400.0, **validation,
                                                   "spo/turns/turns_per_episode": 2.0,
                                                   "spo/turns/value_before_turn2": 0.1 * step})))
        grpo_steps.append((step, training_step(0.2 + 0.05 * step, 5.0, 1000, 10.0, 15.0,
                                               **({ACCURACY: 0.1 + 0.05 * step} if step % 2 == 0 else {}))))
    for label, steps, record in (("SPO-tree", tree_steps, tree_record), ("SPO-chain", chain_steps, chain_record),
                                 ("GRPO+mask", grpo_steps, grpo_record)):
        folder = root / label
        folder.mkdir()
        metrics = log_metrics(folder / "metrics.jsonl", steps, monkeypatch)
        for step in range(1, 5):
            append_record(folder, record(step))
        runs[label] = (metrics, folder / SAMPLES_FILE)
    monkeypatch.undo()
    output = root / "report"
    arguments = [argument for label, (metrics, samples) in runs.items() for argument in ("--run", f"{label}={metrics},{samples}")]
    result = subprocess.run([sys.executable, "-m", "spo_workbench.report", *arguments, "--output", str(output),
                             "--title", "SPO on a recorded run"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return output


def test_generated_tokens_prefer_the_runs_own_count():
    from spo_workbench.report.runs import generated_tokens

    step = training_step(0.5, 1.0, 1000, 10.0, 15.0)
    assert generated_tokens(step) == 600  # 1000 / (10 + 15) = 40 rows of 15 response tokens
    assert generated_tokens({**step, "spo/chain/mc_tokens": 50.0}) == 650
    assert generated_tokens({**step, "spo/tree/generated_tokens": 321.0}) == 321
    assert generated_tokens({**step, "spo/tree/generated_tokens": 321.0, "spo/generated_tokens": 300.0}) == 300
    assert generated_tokens({"critic/score/mean": 0.5}) is None


def test_a_resumed_runs_sample_log_keeps_one_record_a_step_the_later_one(tmp_path):
    from spo_workbench.report.runs import read_samples

    # The stopped attempt logged steps 1-3 (checkpoint at 2); the resumed one logged 3 and 4 again.
    records = [{"step": 1, "attempt": 1}, {"step": 2, "attempt": 1}, {"step": 3, "attempt": 1},
               {"step": 3, "attempt": 2}, {"step": 4, "attempt": 2}]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert [(r["step"], r["attempt"]) for r in read_samples(path)] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert read_samples(None) == []
    # Started again from step 0 after logging further than the final attempt got: none of it is kept.
    records = [{"step": s, "attempt": 1} for s in range(1, 6)] + [{"step": s, "attempt": 2} for s in range(1, 4)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert [(r["step"], r["attempt"]) for r in read_samples(path)] == [(1, 2), (2, 2), (3, 2)]


def test_the_turns_command_reads_each_runs_final_attempt_as_the_study_csv_keeps_it(capsys):
    """The multi-turn study's SPO-tree seeds 1 and 3 were started again from step 0 (attempts.json): their
    sample logs hold 5 and 3 steps of a discarded attempt (4 episodes a step, 32 in all). The command
    reads the final attempts only, the rows of the committed turns_credit.csv, 356 episodes."""
    import csv
    import os

    from spo_workbench.credit import turns

    runs = Path(__file__).resolve().parents[1] / "docs" / "results" / "study4" / "runs"
    old = os.getcwd()
    os.chdir(runs)  # the committed CSV names each run by its folder under runs/
    try:
        rows = [row for run in sorted(Path(".").glob("*/seed*")) for row in turns.read_run(run)]
        assert turns.main([str(run) for run in sorted(Path(".").glob("spo_tree/seed*"))]) == 0
    finally:
        os.chdir(old)
    with open(runs.parent / "turns_credit.csv", newline="") as handle:
        committed = list(csv.DictReader(handle))
    as_text = lambda value: "" if value is None else str(value)  # noqa: E731
    by_run = lambda records: sorted(records, key=lambda r: r["run"])  # noqa: E731  (stable: each run's order kept)
    assert by_run([{k: as_text(v) for k, v in vars(row).items()} for row in rows]) == by_run(committed)
    logged = {seed: len((runs / "spo_tree" / f"seed{seed}" / "samples.jsonl").read_text().splitlines()) for seed in (1, 3)}
    assert logged == {1: 27, 3: 26}  # 22 and 23 steps kept, 5 and 3 discarded
    assert "| `spo_tree` | 4 | 356 | 176 | 66 | 114 | 0 | 0.603 +- 0.020 | 0.923 +- 0.042 | -0.097 +- 0.011 |" in capsys.readouterr().out


def test_the_algorithm_is_told_from_the_sample_log_or_the_metrics():
    from spo_workbench.report.runs import algorithm_of

    tree = {1: {"spo/tree/trees": 4.0}}
    cutpoint = {1: {"spo/tree/trees": 4.0, "spo/tree/paths_per_tree": 3.0}}
    assert algorithm_of(tree, []) == "spo_tree" and algorithm_of(cutpoint, []) == "spo_tree_cutpoint"
    logged = [{"algorithm": "spo_tree", "loss_mode": "spo_prob_mask"}]
    assert algorithm_of(tree, logged) == "spo_tree" and algorithm_of(cutpoint, logged) == "spo_tree_cutpoint"
    assert algorithm_of({1: {}}, [{"algorithm": "grpo", "loss_mode": "spo_prob_mask"}]) == "grpo_prob_mask"
    assert algorithm_of({1: {"spo/chain/mc_tokens": 9.0}}, []) == "spo_chain"
    assert algorithm_of({1: {"critic/vf_loss": 0.1}}, []) == "ppo" and algorithm_of({1: {}}, []) == "grpo"


def test_every_plot_and_table_is_written(recorded_runs):
    for name in OUTPUTS:
        assert (recorded_runs / name).stat().st_size > 0, name
    for name in PLOTS:
        with Image.open(recorded_runs / name) as image:
            assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 400
            image.verify()


def test_results_csv_has_one_row_per_run_and_step_with_the_recorded_numbers(recorded_runs):
    with (recorded_runs / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["run"], int(r["step"])) for r in rows] == [(run, step) for run in ("SPO-tree", "SPO-chain", "GRPO+mask")
                                                          for step in range(5)]
    by_key = {(r["run"], int(r["step"])): r for r in rows}
    tree, chain, grpo = by_key[("SPO-tree", 3)], by_key[("SPO-chain", 3)], by_key[("GRPO+mask", 3)]
    assert float(tree["generated_tokens"]) == 103 and float(tree["cumulative_generated_tokens"]) == 101 + 102 + 103
    # Response tokens = rows x response_length/mean, rows = 1000 / (10 + 15) = 40; SPO-chain adds its MC tokens.
    assert float(grpo["generated_tokens"]) == 600 and float(chain["generated_tokens"]) == 1000
    # Of those, SPO-chain's Monte Carlo continuations, as it logged them; none for the others.
    assert float(chain["monte_carlo_tokens"]) == 400 and tree["monte_carlo_tokens"] == grpo["monte_carlo_tokens"] == ""
    assert float(grpo["cumulative_generated_tokens"]) == 1800
    assert float(tree["training_reward"]) == pytest.approx(0.6) and tree["heldout_accuracy"] == ""
    assert float(by_key[("SPO-tree", 4)]["heldout_accuracy"]) == pytest.approx(0.5)
    assert float(by_key[("SPO-tree", 0)]["heldout_accuracy"]) == pytest.approx(0.1)
    assert by_key[("SPO-tree", 0)]["training_reward"] == "" and float(by_key[("SPO-tree", 0)]["cumulative_generated_tokens"]) == 0
    # Where the blame went, as the step logged it (spo/credit/*); a run or step that logged none: empty.
    assert float(tree["blame_on_error"]) == pytest.approx(0.3) and float(tree["blame_on_error_masked"]) == pytest.approx(0.2)
    assert tree["blame_on_error_net"] == "" and grpo["blame_on_error"] == ""
    # Trained tokens as the SPO estimator logged them; verl's baselines log none.
    assert float(tree["trained_tokens"]) == 43 and grpo["trained_tokens"] == ""
    # What an optimizer update's forward and backward computed, as the packed engine logged it; none without it.
    assert float(tree["actor_tokens_per_update"]) == 153 and grpo["actor_tokens_per_update"] == ""
    assert float(chain["wall_time_s"]) == 20 and float(chain["cumulative_wall_time_s"]) == 60
    # Wall time by phase, from verl's timing_s/<phase> (empty where a phase did not run).
    assert float(tree["gen_s"]) == 4 and float(tree["update_actor_s"]) == 3 and tree["testing_s"] == ""
    assert float(by_key[("SPO-tree", 4)]["testing_s"]) == 1.5 and chain["gen_s"] == ""
    with (recorded_runs / "summary.csv").open() as handle:
        summary = {r["run"]: r for r in csv.DictReader(handle)}
    assert float(summary["SPO-tree"]["final_heldout_accuracy"]) == pytest.approx(0.5)
    assert float(summary["GRPO+mask"]["best_heldout_accuracy"]) == pytest.approx(0.3)
    assert float(summary["SPO-chain"]["total_generated_tokens"]) == 4000
    assert float(summary["SPO-tree"]["total_trained_tokens"]) == 41 + 42 + 43 + 44
    assert summary["GRPO+mask"]["total_trained_tokens"] == ""
    assert float(summary["SPO-tree"]["actor_tokens_per_update"]) == 152.5 and summary["GRPO+mask"]["actor_tokens_per_update"] == ""
    assert summary["SPO-tree"]["algorithm"] == "spo_tree" and summary["SPO-tree"]["accuracy_metric"] == ACCURACY
    assert summary["GRPO+mask"]["algorithm"] == "grpo_prob_mask"  # grpo with the spo_prob_mask loss
    assert float(summary["SPO-tree"]["gen_s"]) == 16 and float(summary["SPO-tree"]["testing_s"]) == 3
    assert float(summary["SPO-chain"]["gen_s"]) == 0
    # The multi-turn metrics (spo/turns/*) of the one run that logged them, every step, in long form.
    with (recorded_runs / "turns.csv").open() as handle:
        turns = list(csv.DictReader(handle))
    assert {r["run"] for r in turns} == {"SPO-chain"} and len(turns) == 4 * 2
    by_metric = {(int(r["step"]), r["metric"]): float(r["value"]) for r in turns}
    assert by_metric[(3, "value_before_turn2")] == pytest.approx(0.3) and by_metric[(1, "turns_per_episode")] == 2


def test_the_page_is_self_contained_and_shows_the_segments_and_the_tree(recorded_runs):
    page = (recorded_runs / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert page.count("data:image/png;base64,") == len(PLOTS)
    # The tree of the last step: V and A of its nodes (root, nodes 1 and 2: V 0.5, A 0; leaves A +-0.5),
    # the leaves' rewards, and every node's segment text.
    tree = tree_record(4)["tree"]
    values = {n["id"]: n["value"] for n in tree["nodes"]}
    assert values == pytest.approx({"root": 0.5, "1": 0.5, "2": 0.5, "3": 1.0, "4": 0.0, "5": 1.0, "6": 0.0})
    assert "<svg class='spo-tree'" in page and page.count("<g class='node'") == 7
    assert "V 0.500" in page and "A +0.500" in page and "A -0.500" in page and "R 1" in page
    for text in (">5</text>", ">2+3</text>", "> #### 5&lt;eos&gt;</text>", "> ok&lt;eos&gt;</text>", ">=5&lt;eos&gt;</text>",
                 ">=6&lt;eos&gt;</text>"):
        assert text in page, text
    # The responses with their segments: every token of the chain response, its two cutpoints.
    chain = chain_record(4)["responses"][0]
    assert all(f">{token.replace('<', '&lt;').replace('>', '&gt;')}</span>" in page for token in chain["tokens"])
    assert "cutpoints (first token of each cut segment): &#x27;+3&#x27; (p=0.40), &#x27;5&#x27; (p=0.30)" in page
    assert page.count("class='seg cut'") >= 2 and "class='tok masked'" in page
    # Each prompt is shown with its responses; the colours come with their numbers.
    assert "prompt of response 0 and those after it until the next prompt: &lt;p&gt;What is 2+3?" in page
    assert "advantage colour: " in page and ">+0.5</span>" in page and ">-0.5</span>" in page
    # GRPO+mask's response: 5 tokens in the loss, advantage -0.7 on all, 2 with p_old below 0.9.
    assert "5 in the loss &middot; 2 with a gradient (non-zero advantage, in the mask)" in page
    # The tree's leaves under GRPO: verl's estimator on rewards 1, 0, 1, 0 gives +-0.5 / std(1, 0, 1, 0).
    assert "Where the credit goes: SPO-tree against GRPO on the same responses" in page
    grpo = 0.5 / np.std([1, 0, 1, 0], ddof=1)
    assert page.count(f"GRPO: A {grpo:+.3f}") == 2 and page.count(f"GRPO: A {-grpo:+.3f}") == 2
    # Wall time by phase in the run table: steps 40 s = generation 16 + actor update 12 + other 12; validation
    # (outside verl's step timer) 3 s.
    assert "generation, s" in page and "<td>40.0</td><td>16</td><td>0</td><td>12</td><td>12</td><td>3</td>" in page


def _chromium_or_skip():
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{CHROMIUM} is missing: CI must install Debian's chromium for the report check")
    pytest.skip(f"{CHROMIUM} is not installed (this check fails instead of skipping under CI=true)")


def test_a_headless_browser_renders_a_non_blank_page(recorded_runs, tmp_path):
    chromium = _chromium_or_skip()
    screenshot = recorded_runs / "report_screenshot.png"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}",
         "--window-size=1200,2000", "--hide-scrollbars", (recorded_runs / "report.html").as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0 and screenshot.exists(), result.stderr[-3000:]
    with Image.open(screenshot) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    assert pixels.shape[:2] == (2000, 1200)
    non_white = (pixels.min(axis=2) < 235).mean()
    assert non_white > 0.03, f"only {non_white:.1%} of the screenshot is not white"
    # The plots' coloured lines and the segments' green/red backgrounds reached the screen.
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    greenish = ((green - red > 40) & (green - blue > 40)).mean()
    assert greenish > 0.0005, f"no green (positive-advantage) area on screen: {greenish:.4%}"


def test_seeds_of_one_algorithm_are_summarised_with_their_standard_error(tmp_path, monkeypatch):
    """Runs labelled NAME/seed<k> are one group: results.csv has the seed, groups.csv the mean and the
    standard error over seeds of the final and best held-out accuracy (best counts validations after
    step 0 only), and the base model's accuracy (step 0)."""
    from spo_workbench.report.__main__ import build_report

    finals = {"spo_tree": [0.30, 0.40, 0.50], "grpo": [0.20, 0.30]}
    arguments = []
    for algorithm, values in finals.items():
        for seed, final in enumerate(values):
            steps = [(0, {ACCURACY: 0.25})]
            trained = ({"spo/trained_tokens": 10.0 * (seed + 1), "spo/packing/packed_tokens": 100.0 * (seed + 1)}
                       if algorithm == "spo_tree" else {})
            steps += [(step, training_step(0.5, 10.0, 1000, 10, 15, **{"spo/generated_tokens": 100.0 + seed, **trained}))
                      for step in (1, 2, 3)]
            steps += [(2, {ACCURACY: 0.1}), (3, {ACCURACY: final})]
            path = log_metrics(tmp_path / f"{algorithm}-{seed}.jsonl", steps, monkeypatch)
            arguments.append(f"{algorithm}/seed{seed}={path}")
    written = build_report(arguments, tmp_path / "report")
    assert "turns.csv" not in written and not (tmp_path / "report" / "turns.csv").exists()  # no multi-turn run
    with written["results.csv"].open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["run"], r["seed"]) for r in rows} == {(f"{a}/seed{s}", str(s)) for a in finals for s in range(len(finals[a]))}
    with written["groups.csv"].open() as handle:
        groups = {r["group"]: r for r in csv.DictReader(handle)}
    tree, grpo = groups["spo_tree"], groups["grpo"]
    assert int(tree["seeds"]) == 3 and float(tree["base_heldout_accuracy"]) == pytest.approx(0.25)
    assert float(tree["final_heldout_accuracy_mean"]) == pytest.approx(0.4)
    assert float(tree["final_heldout_accuracy_se"]) == pytest.approx(0.1 / 3 ** 0.5)  # std 0.1 over 3 seeds
    assert float(grpo["final_heldout_accuracy_se"]) == pytest.approx(0.05)  # std 0.0707 / sqrt(2)
    assert float(grpo["best_heldout_accuracy_mean"]) == pytest.approx(0.25)  # not the base model's 0.25 + ...
    assert float(tree["generated_tokens_mean"]) == pytest.approx(3 * 101)
    assert float(tree["trained_tokens_mean"]) == pytest.approx(3 * 20) and grpo["trained_tokens_mean"] == ""
    assert float(tree["actor_tokens_per_update_mean"]) == pytest.approx(200) and grpo["actor_tokens_per_update_mean"] == ""
    with written["summary.csv"].open() as handle:
        summary = {r["run"]: r for r in csv.DictReader(handle)}
    assert float(summary["grpo/seed0"]["best_heldout_accuracy"]) == pytest.approx(0.2)  # step 0's 0.25 left out
    page = written["report.html"].read_text()
    assert "mean" in page and "&plusmn; 0.058" in page and str(tmp_path) not in page
    for name in ("accuracy_vs_step.png", "accuracy_vs_generated_tokens.png"):
        with Image.open(written[name]) as image:
            assert image.size[0] >= 600


def test_an_episode_is_drawn_turn_by_turn_with_the_environments_tokens_set_apart():
    from spo_workbench.report.page import _response_block

    response = {"uid": "u", "prompt": "Start with 7. Add 3 to that.", "tokens": list("10|-2|8|"),
                "probs": [0.5] * 8, "in_prob_mask": [1, 1, 1, 0, 0, 0, 1, 1], "advantages": [0.25] * 3 + [0.0] * 3 + [0.5] * 2,
                "trained": [1, 1, 1, 0, 0, 0, 1, 1], "score": 1.0, "truncated": False,
                "segments": [{"start": 0, "end": 6, "advantage": 0.25, "value_before": 0.25, "value_after": 0.5,
                              "cutpoint": False, "node": None, "trained": True},
                             {"start": 6, "end": 8, "advantage": 0.5, "value_before": 0.5, "value_after": 1.0,
                              "cutpoint": False, "node": None, "trained": True}],
                "environment": [0, 0, 0, 1, 1, 1, 0, 0],
                "episode": {"turns": 2, "reply_tokens": 3, "ended_by": "environment", "environment_error": None}}
    record = {"prob_mask_threshold": 0.9, "prob_mask_applied": True}
    page = _response_block(record, response, 0, 0.5)
    assert "episode: 2 turn(s) of the model, 3 tokens of the environment (out of the loss), ended by environment" in page
    assert page.count("class='turn'") == 2
    assert "turn 1: V +0.25 &rarr; +0.50, A +0.250" in page and "turn 2: V +0.50 &rarr; +1.00, A +0.500" in page
    environment = re.findall(r"<span class='tok env'[^>]*>([^<]*)</span>", page)
    assert environment == ["-", "2", "|"]  # exactly the environment's tokens, none of the model's
    assert page.count("class='tok masked'") == 5
    single = _response_block(record, {**response, "environment": None, "episode": None}, 0, 0.5)
    assert "class='turn'" not in single and "tok env" not in single


def test_multi_turn_runs_get_the_blame_per_turn_from_their_sample_logs(tmp_path, monkeypatch):
    """Two seeds of an SPO-chain run over turns, each logging one dialogue that goes wrong at turn 2 after
    a right turn 1: turns_credit.csv lists every turn with its credit, the page tables it per algorithm,
    and the runs without a multi-turn episode get neither."""
    from spo_workbench.report.__main__ import build_report

    prompt = "Start with 16. Subtract 9 from that."
    turn1, reply, turn2 = "16 - 9 = 7|", "Add 4 to that.", "7 + 4 = 12|"
    tokens = list(turn1 + reply + turn2)
    second = len(turn1) + len(reply)
    arguments = []
    for seed, first_credit in enumerate((0.25, 0.75)):
        episode = {"uid": "u", "prompt": prompt, "tokens": tokens, "probs": [0.5] * len(tokens),
                   "in_prob_mask": [int(i < len(turn1) or i >= second) for i in range(len(tokens))],
                   "advantages": [first_credit] * second + [-0.5] * len(turn2), "trained": [1] * len(tokens),
                   "score": 0.0, "truncated": False,
                   "segments": [{"start": 0, "end": second, "advantage": first_credit, "value_before": 0.5,
                                 "value_after": 0.5 + first_credit, "cutpoint": False, "node": None, "trained": True},
                                {"start": second, "end": len(tokens), "advantage": -0.5, "value_before": 0.5,
                                 "value_after": 0.0, "cutpoint": False, "node": None, "trained": True}],
                   "environment": [int(len(turn1) <= i < second) for i in range(len(tokens))],
                   "episode": {"turns": 2, "reply_tokens": len(reply), "ended_by": "environment", "environment_error": None}}
        samples = tmp_path / f"samples{seed}.jsonl"
        samples.write_text(json.dumps({"step": 1, "algorithm": "spo_chain", "loss_mode": "spo_prob_mask",
                                       "prob_mask_threshold": 0.9, "prob_mask_applied": True, "responses": [episode]}))
        metrics = log_metrics(tmp_path / f"metrics{seed}.jsonl", [(0, {ACCURACY: 0.25}), (1, training_step(0.0, 1.0, 10, 5, 5))],
                              monkeypatch)
        arguments.append(f"spo_chain/seed{seed}={metrics},{samples}")
    written = build_report(arguments, tmp_path / "report")
    with written["turns_credit.csv"].open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["algorithm"], r["seed"], r["turn"], r["tokens"], r["first_wrong_turn"], float(r["advantage"])) for r in rows] == [
        ("spo_chain", "0", "1", "11", "2", 0.25), ("spo_chain", "0", "2", "11", "2", -0.5),
        ("spo_chain", "1", "1", "11", "2", 0.75), ("spo_chain", "1", "2", "11", "2", -0.5)]
    page = written["report.html"].read_text()
    assert "Where the blame went per turn" in page
    # 2 runs, 2 episodes, none right, none wrong at turn 1, 2 later, 0 not placed; all the blame on turn 2;
    # the right turns' credit 0.25 and 0.75: 0.5 +- 0.25 over the runs.
    cells = ["spo_chain", "2", "2", "0", "0", "2", "0", "1.000 +- 0.000", "1.000 +- 0.000", "0.500 +- 0.250"]
    assert "".join(f"<td>{cell}</td>" for cell in cells) in page
    plain = build_report([arguments[0].split(",")[0]], tmp_path / "plain")
    assert "turns_credit.csv" not in plain and "Where the blame went per turn" not in plain["report.html"].read_text()
