"""Which update is best per generated token: each estimator's gradient against a reference gradient of
expected reward, paired on one policy and one set of prompts (docs/STUDY.md declares the measurement).

    python -m spo_workbench.credit.gradients [--tasks steps3,steps4] [--prompts 8] [--policy base|NAME=MODEL_DIR]
        [--budgets 1500,3000,6000] [--draws 12] [--reference-samples 256] [--parameters last_blocks|all]
        [--estimators NAMES] [--output-dir outputs/gradients] [--quick]
    python -m spo_workbench.credit.gradients --from-draws DRAWS_CSV --output-dir DIR

For every task and policy: the prompts are chosen by the declared rule (candidates outside the task's
training, held-out and tuning problems, each screened with ``--screen-samples`` samples, kept at 2 to 14
right of 16, and kept only when its reference's halves agree, cosine at least 0.2); each prompt's reference
gradient is built from two halves of ``--reference-samples`` plain samples; a cost pass samples one unit of
every estimator a prompt and fixes the units of a draw at each budget; then ``--draws`` draws of every
estimator at every budget it fits, each one row of ``draws.csv`` with its cosine with the reference and
that cosine corrected by the halves' agreement (``spo_workbench.credit.gradient_measures``). Started again with
the same arguments it reuses the prompts, references and costs it kept, and skips every draw already in
``draws.csv``. ``summary.csv``: each estimator's mean corrected cosine a budget (a draw whose update is
zero counts 0, and their number is a column), and against GRPO paired over prompts (mean, standard
error, 95 % interval, the smallest difference found with 80 % power); ``table.md`` the same as a
Markdown table; ``prompts.csv`` each prompt's share of it. ``matching.csv``: the generated tokens each estimator needs to reach GRPO's mean
corrected cosine at GRPO's largest budget. ``pooled.csv``: each tree with its values pooled over
identical prefixes against the same tree with its own, paired over prompts; ``weights.csv`` each tree
under another segment weighting (``algorithm.spo.tree.segment_weight``) against the paper's, on the same
rollouts. ``bias.csv``: bias and noise apart, per prompt (the cosine of each estimator's expected update
with the true gradient, the corrected cosine of the mean of its draws as more are averaged, the noise's
share and the independent responses a draw is worth), from the gradient products each draw row keeps;
``bias_summary.csv`` their means (the bias cosine's median too) and paired differences. ``cost.csv``: the
machine hours recorded. ``cosine_vs_tokens.png``: each estimator's corrected cosine against generated
tokens, each prompt's mean and the mean over prompts; ``cosine_of_mean_vs_tokens.png``: the cosine of the
mean of m draws against their generated tokens. ``--from-draws`` writes these from a kept ``draws.csv``
without measuring anything.

``--quick``: the cpu-tiny setting, 2 prompts, 2 small budgets, 2 draws, references of 2 x 16: the whole
pipeline in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from spo_workbench.credit.gradient_measures import (corrected_cosine, cosine, draw_alignment, halves_reliability,
                                            tokens_to_match)
from spo_workbench.student_t import paired_interval
from spo_workbench.credit.gradient_draws import Estimator, GroupSetup
from spo_workbench.credit.rollouts import PAPER_CHAIN, ChainSetup, TreeSetup, gsm8k_score, paper_tree

SCORE = gsm8k_score  # every response's reward (the tests give the untrained tiny model a reward that varies)
MIN_HALVES_COSINE = 0.2  # a reference whose halves agree less is too noisy to correct by (STUDY.md)
SCREEN_RIGHT = (2, 14)  # of 16 screening samples: a success rate inside 0.1-0.9
UNIT_OVER_BUDGET = 1.5  # a unit dearer than this many budgets is not drawn at that budget

COLUMNS = ("kind", "policy", "prompt_set", "prompt_uid", "estimator", "budget", "draw", "units", "tokens",
           "parameters", "cosine", "corrected_cosine", "halves_cosine", "reward_mean", "sample_seconds",
           "gradient_seconds", "rollout", "dot_reference", "norm_sq", "dot_earlier", "half_a_norm_sq",
           "half_b_norm_sq", "halves_dot")


# The suffix of a tree estimator whose segment values are pooled over identical prefixes.
POOLED = "_pooled"
# The suffixes of a tree estimator under another algorithm.spo.tree.segment_weight than the paper's.
WEIGHTED = {"_paths": "paths", "_sqrt_paths": "sqrt_paths"}


def _tree(name, branching, segments, **kwargs):
    return TreeSetup(name, tuple(branching), tuple(segments), **kwargs)


CUTPOINT = dict(branch_at="cutpoint", cutpoint=("responses=2", "max_forks=1", "width=1", "interval=5"))


def smollm2_estimators(task: str) -> list[Estimator]:
    """The declared estimators, the paper's shapes among them (:func:`paper_tree`, :data:`PAPER_CHAIN`)."""
    trees = {"spo_tree_2_2": _tree("2_2", (2, 2), (10,)), "spo_tree_4_4": _tree("4_4", (4, 4), (10,)),
             "spo_tree_6_6_6": paper_tree(task),
             "spo_tree_cutpoint": _tree("cutpoint", (2, 2), (10,), **CUTPOINT)}
    out = [Estimator("grpo", GroupSetup("grpo"), "grpo", "vanilla"),
           Estimator("grpo_prob_mask", GroupSetup("grpo"), "grpo", "spo_prob_mask"),
           Estimator("grpo_one_group", GroupSetup("grpo_one_group", one_group=True), "grpo", "vanilla", secondary=True)]
    for name, setup in trees.items():
        out += [Estimator(name, setup, "spo_tree", "spo_prob_mask"),
                Estimator(f"{name}{POOLED}", setup, "spo_tree_pooled", "spo_prob_mask"),
                *weighted_trees(name, setup)]
    out += [Estimator("spo_chain_int5_mc9", PAPER_CHAIN, "spo_chain", "spo_prob_mask"),
            Estimator("spo_chain_int5_mc4", ChainSetup("int5_mc4", 4, 5, 4), "spo_chain", "spo_prob_mask")]
    return out


def weighted_trees(name: str, setup: TreeSetup) -> list[Estimator]:
    """The tree ``name`` under every other segment weighting, each on the same rollouts as the tree."""
    from spo_workbench.credit.rollouts import weighted_view

    return [Estimator(f"{name}{suffix}", setup, weighted_view(weight), "spo_prob_mask") for suffix, weight in WEIGHTED.items()]


def quick_estimators() -> list[Estimator]:
    tree = _tree("tiny_2_2", (2, 2), (4,))
    return [Estimator("grpo", GroupSetup("grpo"), "grpo", "vanilla"),
            Estimator("grpo_prob_mask", GroupSetup("grpo"), "grpo", "spo_prob_mask"),
            Estimator("spo_tree_2_2", tree, "spo_tree", "spo_prob_mask"),
            Estimator("spo_tree_2_2_pooled", tree, "spo_tree_pooled", "spo_prob_mask"),
            *weighted_trees("spo_tree_2_2", tree),
            Estimator("spo_chain", ChainSetup("tiny_chain", 2, 8, 2), "spo_chain", "spo_prob_mask")]


@dataclass(frozen=True)
class PromptSet:
    """A task's candidate problems ``(uid, chat messages, ground truth)`` in the order the rule reads them."""

    name: str
    candidates: list
    prompt_length: int
    response_length: int
    screen: bool  # apply the declared screening and reference rules (not on the untrained tiny model)


def smollm2_prompt_set(task: str) -> PromptSet:
    """Candidates outside every split of the task: ``problems(1024, SEED + 3, task)`` less the training,
    held-out and tuning problems (the same draws as ``smollm2.write_data``)."""
    from recipe.spo.cpu_settings import smollm2

    seen = {q for q, _ in smollm2.problems(smollm2.TRAIN_PROBLEMS, smollm2.SEED, task)}
    for seed, count in ((smollm2.SEED + 1, smollm2.STUDY_HELD_OUT_PROBLEMS), (smollm2.SEED + 2, smollm2.TUNE_PROBLEMS)):
        seen |= {q for q, _ in smollm2.problems(count * 4, seed, task)}
    candidates, questions = [], set()
    for question, answer in smollm2.problems(1024, smollm2.SEED + 3, task):
        if question not in seen and question not in questions:
            questions.add(question)
            candidates.append((f"c{len(candidates)}", smollm2.messages(question, task), str(answer)))
    spec = smollm2.TASKS[task]
    return PromptSet(task, candidates, spec.prompt_tokens, spec.response_tokens, screen=True)


def tiny_prompt_set() -> PromptSet:
    from recipe.spo.cpu_settings import tiny

    pairs = tiny.problems()[80:]  # the held-out problems
    candidates = [(f"c{i}", [{"role": "user", "content": tiny.question(a, b)}], str(a + b)) for i, (a, b) in enumerate(pairs)]
    return PromptSet("tiny_add", candidates, 64, 32, screen=False)


@dataclass
class Plan:
    estimators: list[Estimator]
    budgets: list[int]
    draws: int
    prompts: int
    reference_samples: int  # a half
    screen_samples: int
    parameters: str
    policy: str
    model_dir: str


class Measurement:
    """One policy and prompt set against one server: the kept files under ``output_dir`` make it resumable."""

    def __init__(self, plan: Plan, prompt_set: PromptSet, output_dir: Path, client, tokenizer):
        from transformers import AutoModelForCausalLM

        from spo_workbench.credit.gradient_draws import trainable

        self.plan, self.prompt_set, self.client, self.tokenizer = plan, prompt_set, client, tokenizer
        self.output_dir = output_dir
        self.key = f"{plan.policy}-{prompt_set.name}"
        self.model = AutoModelForCausalLM.from_pretrained(plan.model_dir, torch_dtype=torch.float32).eval()
        self.parameters = trainable(self.model, plan.parameters)
        (output_dir / "references").mkdir(parents=True, exist_ok=True)

    # -- prompts and references -------------------------------------------------------------------
    async def choose_prompts(self) -> list[tuple]:
        """The first ``plan.prompts`` candidates that pass the screen and whose reference is reliable;
        every candidate looked at is a line of ``prompts-<policy>-<task>.csv``."""
        from spo_workbench.credit.gradient_draws import group_config, plain_samples

        path = self.output_dir / f"prompts-{self.key}.csv"
        done = {r["prompt_uid"]: r for r in _read(path)}
        chosen = []
        for uid, messages, truth in self.prompt_set.candidates:
            if len(chosen) == self.plan.prompts:
                break
            row = done.get(uid)
            if row is None:
                right = ""
                if self.prompt_set.screen:
                    config = group_config(self.plan.model_dir, self.plan.screen_samples, self.prompt_set.prompt_length,
                                          self.prompt_set.response_length)
                    samples = await plain_samples(config, self.client, self.tokenizer, f"{uid}/screen", messages, truth, SCORE)
                    right = int(sum(leaf.score for leaf in samples))
                passes = not self.prompt_set.screen or SCREEN_RIGHT[0] <= right <= SCREEN_RIGHT[1]
                halves = await self.reference(uid, messages, truth) if passes else None
                reliable = halves is not None and (not self.prompt_set.screen or halves >= MIN_HALVES_COSINE)
                row = {"prompt_uid": uid, "screen_right": right, "screen_samples": self.plan.screen_samples,
                       "halves_cosine": "" if halves is None else halves,
                       "kept": int(passes and reliable)}
                _append(path, row, list(row))
            if int(row["kept"]):
                chosen.append((uid, messages, truth))
        return chosen

    def _reference_file(self, uid: str) -> Path:
        return self.output_dir / "references" / f"{self.key}-{uid}-{self.plan.parameters}.pt"

    async def reference(self, uid, messages, truth) -> float:
        """Two halves of plain samples; keeps their mean gradient and writes the reference row."""
        from spo_workbench.credit.gradient_draws import group_config, plain_samples, reference_half

        file = self._reference_file(uid)
        if file.exists():
            return float(torch.load(file)["halves_cosine"])
        started = time.perf_counter()
        config = group_config(self.plan.model_dir, self.plan.reference_samples, self.prompt_set.prompt_length,
                              self.prompt_set.response_length)
        halves, tokens, rewards, sampled, computed = [], 0, [], 0.0, 0.0
        for half in ("A", "B"):
            leaves = await plain_samples(config, self.client, self.tokenizer, f"{uid}/reference{half}", messages, truth, SCORE)
            sampled += time.perf_counter() - started
            started = time.perf_counter()
            halves.append(reference_half(self.model, self.parameters, leaves))
            computed += time.perf_counter() - started
            started = time.perf_counter()
            tokens += sum(len(leaf.output.response_ids) for leaf in leaves)
            rewards += [leaf.score for leaf in leaves]
        rho = cosine(*halves)
        torch.save({"gradient": (halves[0] + halves[1]) / 2, "halves_cosine": rho}, file)
        a, b = (h.double() for h in halves)
        self.write({"kind": "reference", "prompt_uid": uid, "estimator": "reference", "units": 2 * self.plan.reference_samples,
                    "tokens": tokens, "halves_cosine": rho, "reward_mean": statistics.fmean(rewards),
                    "sample_seconds": sampled, "gradient_seconds": computed, "half_a_norm_sq": float(a @ a),
                    "half_b_norm_sq": float(b @ b), "halves_dot": float(a @ b)})
        return rho

    # -- the cost pass and the draws --------------------------------------------------------------
    def samplings(self) -> dict[str, list[Estimator]]:
        """The estimators by the sampling they share (``gradient_draws.sampling_key``), in declared order."""
        from spo_workbench.credit.gradient_draws import sampling_key

        out: dict[str, list[Estimator]] = {}
        for estimator in self.plan.estimators:
            out.setdefault(sampling_key(estimator), []).append(estimator)
        return out

    async def unit_costs(self, prompts) -> dict[str, float]:
        """Mean generated tokens of one unit of each sampling over the prompts (sampled once, not reused)."""
        from spo_workbench.credit.gradient_draws import sample_draw

        path = self.output_dir / f"units-{self.key}.csv"
        kept = {(r["sampling"], r["prompt_uid"]): float(r["tokens"]) for r in _read(path)}
        for key, estimators in self.samplings().items():
            for uid, messages, truth in prompts:
                if (key, uid) not in kept:
                    draw = await sample_draw(estimators[:1], 1, self.plan.model_dir, self.client, self.tokenizer,
                                             f"{uid}/cost", messages, truth, self.prompt_set.prompt_length,
                                             self.prompt_set.response_length, SCORE)
                    kept[(key, uid)] = draw.tokens
                    _append(path, {"sampling": key, "prompt_uid": uid, "tokens": draw.tokens},
                            ["sampling", "prompt_uid", "tokens"])
        return {key: statistics.fmean(kept[(key, uid)] for uid, _, _ in prompts) for key in self.samplings()}

    async def draws(self, prompts, costs: dict[str, float]) -> None:
        """Every estimator's draws at every budget its unit fits; estimators that share a sampling are
        computed on the same rollouts of a draw. A prompt's draws are all taken before the next prompt's,
        each draw of every estimator in turn, so a measurement stopped part way holds whole prompts
        (or the first draws of one) for every comparison."""
        from spo_workbench.credit.gradient_draws import estimator_gradient, sample_draw

        done = {(r["prompt_uid"], r["estimator"], r["budget"], r["draw"]) for r in _read(self.csv)
                if r["kind"] == "draw" and r["policy"] == self.plan.policy and r["prompt_set"] == self.prompt_set.name
                and r["parameters"] == self.plan.parameters}
        self._check_header()
        for uid, messages, truth in prompts:
            reference = torch.load(self._reference_file(uid))
            for r in range(self.plan.draws):
                for budget in self.plan.budgets:
                    for key, estimators in self.samplings().items():
                        if costs[key] > UNIT_OVER_BUDGET * budget:
                            continue  # the unit does not fit this budget
                        units = max(1, round(budget / costs[key]))
                        pending = [e for e in estimators if (uid, e.name, str(budget), str(r)) not in done]
                        if not pending:
                            continue
                        if len(pending) < len(estimators):
                            raise SystemExit(f"gradients: {self.csv} holds draw {r} of {uid} at {budget} tokens for only "
                                             f"some of {[e.name for e in estimators]}: their rollouts are shared, so "
                                             f"measure into a new --output-dir")
                        started = time.perf_counter()
                        # Every estimator of the sampling on this one rollout, written together: a resume
                        # never pairs estimators on different rollouts.
                        draw = await sample_draw(estimators, units, self.plan.model_dir, self.client, self.tokenizer,
                                                 f"{uid}/b{budget}/d{r}", messages, truth,
                                                 self.prompt_set.prompt_length, self.prompt_set.response_length, SCORE)
                        sampled = time.perf_counter() - started
                        rollout = f"{uid}/b{budget}/d{r}/{os.urandom(4).hex()}"
                        rows = []
                        for estimator in estimators:
                            started = time.perf_counter()
                            gradient = estimator_gradient(self.model, self.parameters, draw.rows[estimator.name],
                                                          estimator.loss_mode)
                            raw = cosine(gradient, reference["gradient"])
                            rows.append({"kind": "draw", "prompt_uid": uid, "estimator": estimator.name, "budget": budget,
                                         "draw": r, "units": units, "tokens": draw.tokens, "cosine": raw,
                                         "corrected_cosine": corrected_cosine(raw, reference["halves_cosine"]),
                                         "halves_cosine": reference["halves_cosine"],
                                         "reward_mean": statistics.fmean(draw.rewards), "sample_seconds": sampled,
                                         "gradient_seconds": time.perf_counter() - started, "rollout": rollout,
                                         **self.keep_gradient(uid, estimator.name, budget, r, gradient, reference["gradient"])})
                        self.write(*rows)

    def _gradient_file(self, uid: str, estimator: str, budget: int, draw: int) -> Path:
        return self.output_dir / "draw_gradients" / f"{self.key}-{uid}-{estimator}-b{budget}-{self.plan.parameters}-d{draw}.pt"

    def keep_gradient(self, uid: str, estimator: str, budget: int, draw: int, gradient: torch.Tensor,
                      reference: torch.Tensor) -> dict:
        """Keeps a draw's gradient and returns what the bias figures need of it (:func:`bias_rows`): its
        products with the reference, with itself and with the sum of the same estimator's earlier draws
        of this prompt (blank if one of those was not kept)."""
        file = self._gradient_file(uid, estimator, budget, draw)
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(gradient, file)
        g = gradient.double()
        earlier = [self._gradient_file(uid, estimator, budget, d) for d in range(draw)]
        dot_earlier = sum(float(g @ torch.load(f).double()) for f in earlier) if all(f.exists() for f in earlier) else ""
        return {"dot_reference": float(g @ reference.double()), "norm_sq": float(g @ g), "dot_earlier": dot_earlier}

    @property
    def csv(self) -> Path:
        return self.output_dir / "draws.csv"

    def _check_header(self) -> None:
        if self.csv.exists():
            with open(self.csv, newline="") as handle:
                header = tuple(next(csv.reader(handle), ()))
            if header != COLUMNS:
                raise SystemExit(f"gradients: {self.csv} was written with other columns ({len(header)}, now "
                                 f"{len(COLUMNS)}): measure into a new --output-dir")

    def write(self, *rows: dict) -> None:
        """Rows of draws.csv, appended in one write."""
        common = {"policy": self.plan.policy, "prompt_set": self.prompt_set.name, "parameters": self.plan.parameters}
        _append(self.csv, [{**{c: "" for c in COLUMNS}, **common, **row} for row in rows], list(COLUMNS))

    async def run(self) -> None:
        prompts = await self.choose_prompts()
        print(f"gradients: {self.key}: {len(prompts)} prompts", flush=True)
        for uid, messages, truth in prompts:  # a choice kept from an earlier measurement: its reference drawn anew
            await self.reference(uid, messages, truth)
        costs = await self.unit_costs(prompts)
        print(f"gradients: {self.key}: tokens a unit " + ", ".join(f"{k} {v:.0f}" for k, v in costs.items()), flush=True)
        await self.draws(prompts, costs)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _append(path: Path, rows: dict | list[dict], columns: list[str]) -> None:
    """A line (or the lines of ``rows``) in one write, flushed: a stopped measurement loses at most the draw
    it was computing."""
    import io

    new = not path.exists()
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    if new:
        writer.writeheader()
    for row in [rows] if isinstance(rows, dict) else rows:
        writer.writerow({k: (_number(k, v) if isinstance(v, float) else v) for k, v in row.items()})
    with open(path, "a", newline="") as handle:
        handle.write(text.getvalue())


# Products of gradients keep 12 digits: the bias figures subtract sums of them.
_PRODUCTS = {"dot_reference", "norm_sq", "dot_earlier", "half_a_norm_sq", "half_b_norm_sq", "halves_dot"}


def _number(column: str, value: float) -> str:
    return f"{value:.12g}" if column in _PRODUCTS else f"{value:.6g}"


class MeasuredDraw(NamedTuple):
    tokens: float
    alignment: float  # draw_alignment's: the corrected cosine, 0 for a zero update
    zero_update: bool  # every unit's rewards agreed: no update, so draws.csv records no cosine


def prompt_draws(draws_csv: Path) -> dict[tuple, dict[str, list[MeasuredDraw]]]:
    """(policy, prompt set, parameters, estimator, budget) -> prompt -> its draws, each draw under its own
    prompt set and under ``all``; draws of a prompt whose halves did not agree are left out."""
    per_prompt: dict[tuple, dict[str, list[MeasuredDraw]]] = {}
    for row in _read(draws_csv):
        if row["kind"] != "draw":
            continue
        cosine_with_reference = float(row["cosine"] or "nan")
        alignment = draw_alignment(cosine_with_reference, float(row["halves_cosine"] or "nan"))
        if alignment is None:
            continue
        draw = MeasuredDraw(float(row["tokens"]), alignment, math.isnan(cosine_with_reference))
        for prompt_set in (row["prompt_set"], "all"):
            key = (row["policy"], prompt_set, row["parameters"], row["estimator"], int(row["budget"]))
            per_prompt.setdefault(key, {}).setdefault(f"{row['prompt_set']}/{row['prompt_uid']}", []).append(draw)
    return per_prompt


def summary_rows(draws_csv: Path, reference: str = "grpo") -> list[dict]:
    """Per (policy, prompt set, parameters, estimator, budget): the prompts and draws, the zero updates
    among them, the mean tokens and corrected cosine (a zero update counting 0; each prompt's draws
    averaged first), and the paired difference from ``reference`` over the prompts both have (95 %
    interval); prompt sets together as ``all``."""
    per_prompt = prompt_draws(draws_csv)
    out = []
    for key, prompts in sorted(per_prompt.items()):
        means = _prompt_means(prompts)
        row = {"policy": key[0], "prompt_set": key[1], "parameters": key[2], "estimator": key[3], "budget": key[4],
               "prompts": len(means), "draws": sum(len(draws) for draws in prompts.values()),
               "zero_updates": sum(d.zero_update for draws in prompts.values() for d in draws),
               "tokens": statistics.fmean(d.tokens for draws in prompts.values() for d in draws),
               "corrected_cosine": statistics.fmean(means.values())}
        base = per_prompt.get((*key[:3], reference, key[4]))
        interval = None if base is None or key[3] == reference else _paired(means, _prompt_means(base))
        if interval is not None:
            row.update({f"minus_{reference}": interval.mean, "se": interval.se, "low": interval.low,
                        "high": interval.high, "detectable": interval.detectable, "verdict": interval.verdict})
        out.append(row)
    return out


def prompt_rows(draws_csv: Path, reference: str = "grpo") -> list[dict]:
    """Per (policy, parameters, estimator, budget, prompt): what :func:`summary_rows` averages over prompts,
    the prompt's draws, zero updates, mean tokens and mean corrected cosine (a zero update counting 0),
    and its difference from ``reference`` on the same prompt, so one prompt's share of a verdict shows."""
    per_prompt = {key: prompts for key, prompts in prompt_draws(draws_csv).items() if key[1] != "all"}
    out = []
    for key, prompts in sorted(per_prompt.items()):
        means = _prompt_means(prompts)
        base = per_prompt.get((*key[:3], reference, key[4]))
        base_means = _prompt_means(base) if base is not None and key[3] != reference else {}
        for uid, draws in sorted(prompts.items()):
            out.append({"policy": key[0], "prompt_set": key[1], "parameters": key[2], "estimator": key[3],
                        "budget": key[4], "prompt_uid": uid.split("/", 1)[1], "draws": len(draws),
                        "zero_updates": sum(d.zero_update for d in draws),
                        "tokens": statistics.fmean(d.tokens for d in draws), "corrected_cosine": means[uid],
                        f"minus_{reference}": means[uid] - base_means[uid] if uid in base_means else None})
    return out


def _prompt_means(prompts: dict[str, list[MeasuredDraw]]) -> dict[str, float]:
    """Each prompt's mean alignment over its draws (a zero update counting 0)."""
    return {uid: statistics.fmean(d.alignment for d in draws) for uid, draws in prompts.items()}


def _paired(means: dict[str, float], base_means: dict[str, float]):
    """The paired difference over the prompts both have (95 % interval), or None where they share none."""
    shared = sorted(set(means) & set(base_means))
    return paired_interval([means[u] - base_means[u] for u in shared], unit="prompts") if shared else None



def variant_rows(draws_csv: Path, suffixes) -> list[dict]:
    """Each tree estimator with one of ``suffixes`` (the tree with pooled values, or under another segment
    weighting) minus the same tree as the paper computes it, paired over prompts (95 % interval), per
    (policy, prompt set, parameters, tree, budget). Both are computed on the same rollouts of each draw,
    so the difference is the variant's alone."""
    per_prompt = prompt_draws(draws_csv)
    out = []
    for key, prompts in sorted(per_prompt.items()):
        suffix = _variant_suffix(key[3], suffixes)
        if suffix is None:
            continue
        tree = key[3].removesuffix(suffix)
        own = per_prompt.get((*key[:3], tree, key[4]))
        interval = None if own is None else _paired(_prompt_means(prompts), _prompt_means(own))
        if interval is None:
            continue
        out.append({"policy": key[0], "prompt_set": key[1], "parameters": key[2], "tree": tree,
                    "variant": suffix.removeprefix("_"), "budget": key[4], "prompts": interval.n,
                    "variant_minus_own": interval.mean, "se": interval.se, "low": interval.low, "high": interval.high,
                    "detectable": interval.detectable, "verdict": interval.verdict})
    return out


def _variant_suffix(estimator: str, suffixes) -> str | None:
    """The longest of ``suffixes`` that ``estimator`` ends with (``_sqrt_paths`` before ``_paths``)."""
    return max((x for x in suffixes if estimator.endswith(x)), key=len, default=None)


def pooled_rows(draws_csv: Path) -> list[dict]:
    """The declared secondary "each tree with against without pooled values" (:func:`variant_rows`)."""
    return [{**{k: v for k, v in row.items() if k not in ("variant", "variant_minus_own")},
             "pooled_minus_own": row["variant_minus_own"]} for row in variant_rows(draws_csv, (POOLED,))]


# -- bias and noise apart -------------------------------------------------------------------------------


def bias_rows(draws_csv: Path) -> list[dict]:
    """Per (policy, prompt set, parameters, estimator, budget, prompt), from the products each draw row
    keeps (``dot_reference``, ``norm_sq``, ``dot_earlier``) and its reference row's halves:

    * ``bias_cosine``: the cosine of the estimator's *expected* update with the true gradient, what no
      number of tokens changes: ``mean_r g_r . ref / sqrt(mean_(r < s) g_r . g_s * hA . hB)``, each factor
      an unbiased estimate (independent draws; the halves' product for the true gradient's squared norm);
    * ``mean_cosine``: the corrected cosine of the mean of all the prompt's draws with the reference;
    * ``noise_share``: the draws' noise ``mean |g_r|^2 - mean_(r < s) g_r . g_s`` over ``mean |g_r|^2``;
    * ``effective_responses``: how many independent plain responses (the reference's leave-one-out
      estimate) have the ratio of squared mean to noise that one draw has.

    Empty where a draw's products were not kept or the estimates are not positive."""
    rows = _read(draws_csv)
    references = {(r["policy"], r["prompt_set"], r["parameters"], r["prompt_uid"]): r for r in rows
                  if r["kind"] == "reference" and r.get("halves_dot")}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kind"] == "draw":
            groups.setdefault((r["policy"], r["prompt_set"], r["parameters"], r["estimator"], int(r["budget"]),
                               r["prompt_uid"]), []).append(r)
    out = []
    for key, draws in sorted(groups.items()):
        reference = references.get((*key[:3], key[5]))
        draws = sorted(draws, key=lambda d: int(d["draw"]))
        if reference is None or len(draws) < 2 or any(d.get("dot_earlier", "") == "" for d in draws):
            continue
        figures = _bias_figures([float(d["dot_reference"]) for d in draws], [float(d["norm_sq"]) for d in draws],
                                [float(d["dot_earlier"]) for d in draws], float(reference["half_a_norm_sq"]),
                                float(reference["half_b_norm_sq"]), float(reference["halves_dot"]),
                                int(reference["units"]) // 2)
        out.append({"policy": key[0], "prompt_set": key[1], "parameters": key[2], "estimator": key[3], "budget": key[4],
                    "prompt_uid": key[5], "draws": len(draws),
                    "tokens": statistics.fmean(float(d["tokens"]) for d in draws), **figures})
    return out


def _bias_figures(dot_reference: list[float], norm_sq: list[float], dot_earlier: list[float], half_a: float,
                  half_b: float, halves_dot: float, half_samples: int) -> dict:
    """:func:`bias_rows`' figures for one prompt's draws in order; ``cosine_of_mean_m``: the corrected
    cosine of the mean of the first m draws (m = 1 .. M) with the reference."""
    draws = len(norm_sq)
    reference_norm = math.sqrt(max((half_a + half_b + 2 * halves_dot) / 4, 0.0))
    reliability = halves_reliability(halves_dot / math.sqrt(half_a * half_b)) \
        if half_a > 0 and half_b > 0 and halves_dot > 0 else math.nan
    by_draws, sum_sq, sum_dot = [], 0.0, 0.0
    for m in range(draws):
        sum_sq += norm_sq[m] + 2 * dot_earlier[m]
        sum_dot += dot_reference[m]
        norm = math.sqrt(max(sum_sq, 0.0)) * reference_norm
        by_draws.append(sum_dot / norm / math.sqrt(reliability) if norm > 0 and reliability > 0 else math.nan)
    pairs = sum(dot_earlier) / (draws * (draws - 1) / 2)  # mean g_r . g_s over r < s: |E g|^2
    mean_dot = statistics.fmean(dot_reference)
    bias = mean_dot / math.sqrt(pairs * halves_dot) if pairs > 0 and halves_dot > 0 else math.nan
    noise = statistics.fmean(norm_sq) - pairs
    # One plain response's noise and squared signal, from the halves: |hA - hB|^2 / 2 is a half's noise.
    response_noise = half_samples * (half_a + half_b - 2 * halves_dot) / 2
    effective = (pairs / noise) * response_noise / halves_dot if noise > 0 and pairs > 0 and halves_dot > 0 else math.nan
    return {"bias_cosine": bias, "mean_cosine": by_draws[-1],
            "noise_share": noise / statistics.fmean(norm_sq) if statistics.fmean(norm_sq) > 0 else math.nan,
            "effective_responses": effective, "cosine_of_mean_by_draws": " ".join(f"{c:.4g}" for c in by_draws)}


def bias_summary_rows(bias: list[dict], reference: str = "grpo") -> list[dict]:
    """Per (policy, parameters, estimator, budget), over every prompt: the mean of each bias figure, and the
    bias cosine's paired difference from ``reference`` and, for a tree variant, from its tree (95 %), over
    the prompts where both are estimable. The bias cosine's median beside its mean: a ratio of two
    estimates, it runs far past 1 on a prompt whose draws' mean barely rises above their noise."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for row in bias:
        by_key.setdefault((row["policy"], row["parameters"], row["estimator"], row["budget"]), {})[
            f"{row['prompt_set']}/{row['prompt_uid']}"] = row
    out = []
    for key, prompts in sorted(by_key.items()):
        finite = {u: r for u, r in prompts.items() if not math.isnan(r["bias_cosine"])}
        row = {"policy": key[0], "parameters": key[1], "estimator": key[2], "budget": key[3], "prompts": len(prompts),
               "prompts_with_bias": len(finite),
               "bias_cosine": statistics.fmean(r["bias_cosine"] for r in finite.values()) if finite else math.nan,
               "bias_cosine_median": statistics.median(r["bias_cosine"] for r in finite.values()) if finite else math.nan,
               "mean_cosine": statistics.fmean(r["mean_cosine"] for r in prompts.values()),
               "noise_share": statistics.fmean(r["noise_share"] for r in prompts.values()),
               "effective_responses": _finite_mean(r["effective_responses"] for r in prompts.values())}
        suffix = _variant_suffix(key[2], (*WEIGHTED, POOLED))
        for name, against in ((reference, reference), ("tree", key[2].removesuffix(suffix) if suffix else None)):
            other = by_key.get((key[0], key[1], against, key[3])) if against and against != key[2] else None
            shared = sorted(set(finite) & {u for u, r in (other or {}).items() if not math.isnan(r["bias_cosine"])})
            if shared:
                interval = paired_interval([finite[u]["bias_cosine"] - other[u]["bias_cosine"] for u in shared], unit="prompts")
                row.update({f"bias_minus_{name}": interval.mean, f"bias_minus_{name}_low": interval.low,
                            f"bias_minus_{name}_high": interval.high})
        out.append(row)
    return out


def averaging_curves(bias: list[dict]) -> dict[tuple[str, str, str], list[tuple[float, float, int]]]:
    """Per (policy, parameters, estimator): for m = 1, 2, ... the generated tokens of m draws (m times the
    mean tokens a draw) and the mean over prompts of the corrected cosine of the mean of a prompt's first
    m draws (``cosine_of_mean_by_draws``), over the prompts where it is defined (m draws kept, their mean
    not zero), and their number. An unbiased estimator's curve climbs towards 1 as draws are averaged; a
    biased one's levels off below."""
    by_key: dict[tuple[str, str, str], list[dict]] = {}
    for row in bias:
        by_key.setdefault((row["policy"], row["parameters"], row["estimator"]), []).append(row)
    curves = {}
    for key, rows in sorted(by_key.items()):
        per_prompt = [[float(c) for c in row["cosine_of_mean_by_draws"].split()] for row in rows]
        tokens = statistics.fmean(float(row["tokens"]) for row in rows)
        curve = []
        for m in range(1, max(len(c) for c in per_prompt) + 1):
            values = [c[m - 1] for c in per_prompt if len(c) >= m and not math.isnan(c[m - 1])]
            if values:
                curve.append((m * tokens, statistics.fmean(values), len(values)))
        curves[key] = curve
    return curves


def _finite_mean(values) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def matching_rows(summary: list[dict], reference: str = "grpo") -> list[dict]:
    """Per (policy, prompt set, parameters, estimator): the generated tokens it needs to reach
    ``reference``'s mean corrected cosine at the reference's largest budget (the declared 6,000 by
    default), interpolated in log tokens between its own budgets; empty where it stays below."""
    groups: dict[tuple, dict[str, list[tuple[float, float, int]]]] = {}
    for row in summary:
        key = (row["policy"], row["prompt_set"], row["parameters"])
        groups.setdefault(key, {}).setdefault(row["estimator"], []).append(
            (float(row["tokens"]), float(row["corrected_cosine"]), int(row["budget"])))
    out = []
    for key, estimators in sorted(groups.items()):
        if reference not in estimators:
            continue
        _, target, budget = max(estimators[reference], key=lambda point: point[2])
        for name, points in sorted(estimators.items()):
            if name == reference:
                continue
            tokens = tokens_to_match([(t, c) for t, c, _ in points], target)
            out.append({"policy": key[0], "prompt_set": key[1], "parameters": key[2], "estimator": name,
                        f"{reference}_budget": budget, f"{reference}_corrected_cosine": target,
                        "tokens_to_match": "" if tokens is None else tokens})
    return out


def cost_rows(draws_csv: Path) -> list[dict]:
    """The machine time recorded in ``draws_csv``, per policy and prompt set and in all: the references'
    sampling and gradients, the draws' sampling (rows computed on one rollout carry its time alike, so
    each rollout counts once) and the draws' gradients. The screening, the cost pass and start-up are not
    recorded there."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    rollouts = set()
    for row in _read(draws_csv):
        for prompt_set in (row["prompt_set"], "all"):
            total = totals.setdefault((row["policy"], prompt_set), dict.fromkeys(
                ("reference_seconds", "draw_sample_seconds", "draw_gradient_seconds"), 0.0))
            if row["kind"] == "reference":
                total["reference_seconds"] += float(row["sample_seconds"]) + float(row["gradient_seconds"])
                continue
            rollout = (row["policy"], prompt_set, row["prompt_uid"], row["budget"], row["draw"], row["tokens"],
                       row["sample_seconds"])
            if rollout not in rollouts:
                rollouts.add(rollout)
                total["draw_sample_seconds"] += float(row["sample_seconds"])
            total["draw_gradient_seconds"] += float(row["gradient_seconds"])
    return [{"policy": policy, "prompt_set": prompt_set, **total, "machine_hours": sum(total.values()) / 3600}
            for (policy, prompt_set), total in sorted(totals.items())]


def _write_table(path: Path, columns: list[str], rows: list[dict]) -> list[dict]:
    """``rows`` as a CSV table at ``path``, floats to 4 significant digits; returns ``rows``."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    return rows


def write_matching(summary: list[dict], path: Path) -> list[dict]:
    rows = matching_rows(summary)
    columns = ["policy", "prompt_set", "parameters", "estimator", "grpo_budget", "grpo_corrected_cosine",
               "tokens_to_match"]
    return _write_table(path, columns, rows)


def render_summary(summary: list[dict], reference: str = "grpo") -> str:
    """summary.csv as a Markdown table (the one RESULTS.md quotes): cosines to 3 decimals, tokens whole."""
    lines = [f"| policy | prompt set | estimator | budget | prompts | draws (zero updates) | tokens a draw | "
             f"corrected cosine | minus {reference} [95 % interval] | smallest detectable | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary:
        difference = row.get(f"minus_{reference}")
        against = "-" if difference is None else (
            f"{difference:+.3f}" if row["low"] is None else f"{difference:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]")
        detectable = "-" if row.get("detectable") is None else f"{row['detectable']:.3f}"
        lines.append(f"| {row['policy']} | {row['prompt_set']} | {row['estimator']} | {row['budget']} | {row['prompts']} | "
                     f"{row['draws']} ({row['zero_updates']}) | {row['tokens']:.0f} | {row['corrected_cosine']:.3f} | "
                     f"{against} | {detectable} | {row.get('verdict', '-')} |")
    return "\n".join(lines) + "\n"


def write_summary(draws_csv: Path, path: Path) -> list[dict]:
    rows = summary_rows(draws_csv)
    columns = ["policy", "prompt_set", "parameters", "estimator", "budget", "prompts", "draws", "zero_updates",
               "tokens", "corrected_cosine",
               "minus_grpo", "se", "low", "high", "detectable", "verdict"]
    return _write_table(path, columns, rows)


async def measure(plan: Plan, prompt_set: PromptSet, output_dir: Path, client=None) -> None:
    """One policy and prompt set, on its own verl server unless ``client`` is that of one serving the
    policy's model."""
    from transformers import AutoTokenizer

    from spo_workbench.testing.verl_server import start_verl_server

    server = None
    if client is None:
        server = await start_verl_server(plan.model_dir, prompt_length=prompt_set.prompt_length,
                                         response_length=prompt_set.response_length)
        client = server.client
    try:
        await Measurement(plan, prompt_set, output_dir, client, AutoTokenizer.from_pretrained(plan.model_dir)).run()
    finally:
        if server is not None:
            server.shutdown()


COST_COLUMNS = ("policy", "prompt_set", "prompt_uid", "phase", "estimator", "budget", "units", "rows", "tokens",
                "row_tokens", "parameters", "sample_seconds", "gradient_seconds", "load_average")


async def time_one_draw(plan: Plan, prompt_set: PromptSet, path: Path, client=None) -> list[dict]:
    """What the declared counts cost, timed without computing any cosine: on the first candidate prompt,
    one screening, one reference half, then for each estimator one unit (the cost pass) and one draw at
    the largest budget it fits, its gradient included. One row a phase in ``path``."""
    from transformers import AutoTokenizer

    from spo_workbench.credit.gradient_draws import (estimator_gradient, group_config, plain_samples, reference_half,
                                                      sample_draw)
    from spo_workbench.testing.verl_server import start_verl_server

    server = None
    if client is None:
        server = await start_verl_server(plan.model_dir, prompt_length=prompt_set.prompt_length,
                                         response_length=prompt_set.response_length)
        client = server.client
    rows = []

    def record(**row):
        full = {"policy": plan.policy, "prompt_set": prompt_set.name, "prompt_uid": uid, "parameters": plan.parameters,
                "load_average": os.getloadavg()[0], **row}
        rows.append(full)
        _append(path, full, list(COST_COLUMNS))
        print("gradients: cost " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)

    try:
        measurement = Measurement(plan, prompt_set, path.parent, client, AutoTokenizer.from_pretrained(plan.model_dir))
        uid, messages, truth = prompt_set.candidates[0]
        for phase, samples in (("screen", plan.screen_samples), ("reference_half", plan.reference_samples)):
            started = time.perf_counter()
            config = group_config(plan.model_dir, samples, prompt_set.prompt_length, prompt_set.response_length)
            leaves = await plain_samples(config, client, measurement.tokenizer, f"{uid}/{phase}", messages, truth, SCORE)
            sampled, started = time.perf_counter() - started, time.perf_counter()
            if phase == "reference_half":
                reference_half(measurement.model, measurement.parameters, leaves)
            tokens = sum(len(leaf.output.response_ids) for leaf in leaves)
            record(phase=phase, estimator="", budget="", units=samples, rows=len(leaves), tokens=tokens,
                   row_tokens=sum(len(leaf.output.prompt_ids) for leaf in leaves) + tokens, sample_seconds=sampled,
                   gradient_seconds=time.perf_counter() - started if phase == "reference_half" else 0.0)
        for key, estimators in measurement.samplings().items():
            started = time.perf_counter()
            unit = await sample_draw(estimators[:1], 1, plan.model_dir, client, measurement.tokenizer, f"{uid}/cost",
                                     messages, truth, prompt_set.prompt_length, prompt_set.response_length, SCORE)
            record(phase="unit", estimator=key, budget="", units=1, rows=len(unit.rows[estimators[0].name]),
                   tokens=unit.tokens, row_tokens="", sample_seconds=time.perf_counter() - started, gradient_seconds=0.0)
            fitting = [b for b in plan.budgets if unit.tokens <= UNIT_OVER_BUDGET * b]
            if not fitting:
                continue
            budget = max(fitting)
            units = max(1, round(budget / unit.tokens))
            started = time.perf_counter()
            draw = await sample_draw(estimators, units, plan.model_dir, client, measurement.tokenizer, f"{uid}/timed",
                                     messages, truth, prompt_set.prompt_length, prompt_set.response_length, SCORE)
            sampled = time.perf_counter() - started
            for estimator in estimators:
                started = time.perf_counter()
                estimator_gradient(measurement.model, measurement.parameters, draw.rows[estimator.name], estimator.loss_mode)
                draw_rows = draw.rows[estimator.name]
                record(phase="draw", estimator=estimator.name, budget=budget, units=units, rows=len(draw_rows),
                       tokens=draw.tokens, row_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in draw_rows),
                       sample_seconds=sampled, gradient_seconds=time.perf_counter() - started)
                sampled = 0.0  # the rollouts are shared: counted once
    finally:
        if server is not None:
            server.shutdown()
    return rows


def _policy(spec: str) -> tuple[str, str]:
    if spec == "base":
        from recipe.spo.cpu_settings import smollm2

        return "base", smollm2.build(smollm2.default_cache())["model"]
    name, _, path = spec.partition("=")
    if not path:
        raise SystemExit(f"--policy must be 'base' or NAME=MODEL_DIR, got {spec!r}")
    return name, path


def quick_plan(parameters: str = "last_blocks") -> tuple[Plan, PromptSet]:
    """``--quick``: cpu-tiny (its cache at ``SPO_CPU_CACHE``), 2 prompts, budgets of 100 and 200 tokens,
    2 draws, references of 2 x 16 samples, no screening (the rule is for SmolLM2's prompts)."""
    from recipe.spo.cpu_settings import tiny

    cache = Path(os.environ.get("SPO_CPU_CACHE", Path.home() / ".cache" / "spo-verl" / "cpu-tiny"))
    model_dir = tiny.build(cache)["model"]
    return Plan(quick_estimators(), [100, 200], 2, 2, 16, 0, parameters, "tiny", model_dir), tiny_prompt_set()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.credit.gradients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="steps3,steps4")
    parser.add_argument("--prompts", type=int, default=8, help="prompts a task")
    parser.add_argument("--policy", default="base", help="base (SmolLM2-135M-Instruct as built) or NAME=MODEL_DIR")
    parser.add_argument("--budgets", default="1500,3000,6000", help="generated tokens a prompt a draw")
    parser.add_argument("--draws", type=int, default=12)
    parser.add_argument("--reference-samples", type=int, default=256, help="plain samples in each half of a reference")
    parser.add_argument("--screen-samples", type=int, default=16)
    parser.add_argument("--parameters", default="last_blocks", choices=("last_blocks", "all"))
    parser.add_argument("--estimators", default=None, help="a subset of the declared estimators (default: all)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/gradients"))
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, 2 prompts, 2 budgets, 2 draws")
    parser.add_argument("--from-draws", type=Path, metavar="CSV",
                        help="measure nothing: write summary.csv, table.md, matching.csv, pooled.csv, cost.csv and the plot from "
                             "this draws.csv")
    parser.add_argument("--time-one-draw", type=Path, metavar="CSV",
                        help="compute no cosine: time one screening, one reference half and one draw of each estimator "
                             "on each task's first candidate, one row a phase in CSV")
    args = parser.parse_args(argv)
    if args.from_draws is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        summarise(args.from_draws, args.output_dir)
        return 0
    if args.quick:
        plans = [quick_plan(args.parameters)]
    else:
        policy, model_dir = _policy(args.policy)
        plans = []
        for task in [t for t in args.tasks.split(",") if t]:
            estimators = smollm2_estimators(task)
            if args.estimators:
                wanted = args.estimators.split(",")
                unknown = set(wanted) - {e.name for e in estimators}
                if unknown:
                    parser.error(f"unknown estimators {sorted(unknown)}; declared: {','.join(e.name for e in estimators)}")
                estimators = [e for e in estimators if e.name in wanted]
            budgets = [int(b) for b in args.budgets.split(",")]
            plans.append((Plan(estimators, budgets, args.draws, args.prompts, args.reference_samples, args.screen_samples,
                               args.parameters, policy, model_dir), smollm2_prompt_set(task)))
    from spo_verl.adapters.cpu_platform.environment import cpu_run_env

    os.environ.update({key: os.environ.get(key, value) for key, value in cpu_run_env().items()})
    if args.time_one_draw is not None:
        args.time_one_draw.parent.mkdir(parents=True, exist_ok=True)
        for plan, prompt_set in plans:
            asyncio.run(time_one_draw(plan, prompt_set, args.time_one_draw))
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for plan, prompt_set in plans:
        asyncio.run(measure(plan, prompt_set, args.output_dir))
    summarise(args.output_dir / "draws.csv", args.output_dir)
    return 0


def summarise(draws_csv: Path, output_dir: Path) -> list[dict]:
    """summary.csv (and as Markdown, table.md), prompts.csv, matching.csv, pooled.csv, cost.csv and the plot of corrected cosine
    against tokens, from ``draws_csv`` alone."""
    from spo_workbench.credit.figures import averaging_plot, gradient_plot

    summary = write_summary(draws_csv, output_dir / "summary.csv")
    (output_dir / "table.md").write_text(render_summary(summary))
    write_matching(summary, output_dir / "matching.csv")
    _write_table(output_dir / "prompts.csv", ["policy", "prompt_set", "parameters", "estimator", "budget", "prompt_uid",
                                              "draws", "zero_updates", "tokens", "corrected_cosine", "minus_grpo"],
                 prompt_rows(draws_csv))
    _write_table(output_dir / "pooled.csv", ["policy", "prompt_set", "parameters", "tree", "budget", "prompts",
                                             "pooled_minus_own", "se", "low", "high", "detectable", "verdict"],
                 pooled_rows(draws_csv))
    _write_table(output_dir / "weights.csv", ["policy", "prompt_set", "parameters", "tree", "variant", "budget", "prompts",
                                              "variant_minus_own", "se", "low", "high", "detectable", "verdict"],
                 variant_rows(draws_csv, tuple(WEIGHTED)))
    bias = bias_rows(draws_csv)
    _write_table(output_dir / "bias.csv", ["policy", "prompt_set", "parameters", "estimator", "budget", "prompt_uid",
                                           "draws", "tokens", "bias_cosine", "mean_cosine", "noise_share",
                                           "effective_responses", "cosine_of_mean_by_draws"], bias)
    _write_table(output_dir / "bias_summary.csv", ["policy", "parameters", "estimator", "budget", "prompts",
                                                   "prompts_with_bias", "bias_cosine", "bias_cosine_median", "mean_cosine", "noise_share",
                                                   "effective_responses", "bias_minus_grpo", "bias_minus_grpo_low",
                                                   "bias_minus_grpo_high", "bias_minus_tree", "bias_minus_tree_low",
                                                   "bias_minus_tree_high"], bias_summary_rows(bias))
    _write_table(output_dir / "cost.csv", ["policy", "prompt_set", "reference_seconds", "draw_sample_seconds",
                                           "draw_gradient_seconds", "machine_hours"], cost_rows(draws_csv))
    gradient_plot(prompt_draws(draws_csv), output_dir / "cosine_vs_tokens.png")
    if bias:
        averaging_plot(averaging_curves(bias), output_dir / "cosine_of_mean_vs_tokens.png")
    for row in summary:
        if row["prompt_set"] == "all":
            extra = f"  minus grpo {row['minus_grpo']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]" if row.get("low") is not None else ""
            print(f"gradients: {row['policy']} {row['estimator']:<24} {row['budget']:>6} tokens {row['tokens']:>7.0f} "
                  f"corrected cosine {row['corrected_cosine']:.3f}{extra}")
    print(f"gradients: summary.csv, table.md, prompts.csv, matching.csv, pooled.csv, weights.csv, bias.csv, bias_summary.csv, cost.csv, "
          f"cosine_vs_tokens.png{', cosine_of_mean_vs_tokens.png' if bias else ''} in {output_dir}")
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
