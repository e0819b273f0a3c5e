"""The benchmark command: runs every measurement, prints the Markdown and writes it to ``--output``.

    python -m spo_workbench.benchmarks [--quick] [--skip-rollout] [--skip-packing] [--skip-step] [--skip-smollm2-rollout]
                                  [--output docs/BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

from spo_workbench.benchmarks import gpu_report, maths, rollout, tokens, tree_rollout
from spo_workbench.benchmarks.report import Report, header, render, table
from spo_workbench.benchmarks.timing import compare, measure_memory_case, memory_report
from spo_workbench.benchmarks.tree_rollout_report import SMOLLM2_MODEL, benchmark_smollm2_trees, tree_section
from spo_verl.core.rollout.tree import aligned_budgets
from spo_workbench import REPO

ESTIMATOR_TARGET = 3.0
LOSS_TARGET = 1.1
STEP_SHARE_TARGET = 0.01


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


# ------------------------------------------------------------------------------------------------
# Maths (no model)
# ------------------------------------------------------------------------------------------------


def run_maths(report: Report, quick: bool, repeats: int, threads: int) -> dict:
    results: dict = {}
    memory = memory_report("spo_workbench.benchmarks", maths.MEMORY_CASES, quick, threads)

    def mem(case: str) -> str:
        return f"{memory[case]['peak_mib']:.0f}"

    # Advantage estimators at cluster size, through verl's registry.
    rows = []
    paper = tokens.paper_counts()
    step_tokens = {"spo_tree": paper["spo_tree_rows"] * paper["prompts_per_step"]}
    chain_data = maths.chain_batch(quick)
    tree_data = maths.tree_batch(quick)
    for name, data, kind in (("spo_chain", chain_data, "estimator-chain"), ("spo_tree", tree_data, "estimator-tree")):
        comparison = compare(maths.estimator_call(name, data), maths.estimator_call("grpo", data), repeats)
        batch, width = data.shape
        label = (f"{batch} responses x {width} tokens ({maths.CHAIN_PER_PROMPT} per prompt)" if name == "spo_chain"
                 else f"{len(set(data.index))} trees x {batch // len(set(data.index))} leaves x {width} tokens")
        # Lower bound of a training step at this batch: 6 N FLOPs per token (prompt ~150 + response).
        trained = int(data.response_mask.sum()) + 150 * batch
        step = tokens.step_seconds_lower_bound(trained)
        share = comparison.a_median / step
        results[name] = {"comparison": comparison, "step_lower_bound_s": step, "share": share, "label": label}
        rows.append([f"`{name}` vs `grpo`", label, _ms(comparison.b_median), _ms(comparison.a_median),
                     comparison.ratio_text(), f"{mem(kind + '/grpo')} / {mem(kind + '/' + name)}",
                     f"{step:.0f} s", f"{share:.3%}"])
        report.target(f"3. `{name}` vs verl `grpo`, {label}", f"<= {ESTIMATOR_TARGET:g}x",
                      comparison.ratio_text(), comparison.ratio <= ESTIMATOR_TARGET,
                      "" if comparison.ratio <= ESTIMATOR_TARGET else _estimator_reason(name))
        report.target(f"3. `{name}` share of a training step", f"well under {STEP_SHARE_TARGET:.0%}",
                      f"{share:.3%} of a {step:.0f} s lower bound", share < STEP_SHARE_TARGET,
                      "" if share < STEP_SHARE_TARGET else
                      f"against a deliberately generous lower bound (the actor update alone at 50 % MFU on 8 H100s); "
                      f"the rollout of every tree node and the log-prob passes come on top but are not measured "
                      f"here (no GPU), and {comparison.a_median * 1e3:.0f} ms is one thread of a shared 2-core "
                      f"machine; the Python pass over the {batch} rows' metadata (forest building) is the rest "
                      f"to cut.")
    e2e = e2e_step_times()
    report.add("3. Advantage estimation at cluster size (no model)", f"""
Both sides through verl's own registry (`verl.trainer.ppo.core_algos.get_adv_estimator_fn`) on the same
tensors, as verl's `compute_advantage` calls them: `grpo` with `norm_adv_by_std_in_grpo=True` (verl's
default), `spo_chain`/`spo_tree` with their per-row SPO metadata handed over by
`spo_verl.adapters.advantage_channel.provide_spo_rows` as the SPO trainer does. Chains: responses of 1/4 to all of
the width, 1-64 segments each at random cutpoints; trees: full 6-6-6 trees, one row per leaf, segments of
width/3 tokens above the last depth. verl computes advantages on the driver's CPU, so these CPU figures
are the ones that count on a cluster too.

{table(["comparison", "batch", "grpo ms", "SPO ms", "SPO / grpo", "peak MiB grpo / SPO", "step lower bound", "SPO share of step"], rows)}

Share of a training step: a training step at this batch size cannot take less than the actor update
alone, 6 x 1.5e9 FLOPs per trained token (prompt ~150 + response tokens of the batch) on 8 H100s at
50 % of their 989 dense bf16 TFLOP/s, i.e. the "step lower bound" column; rollout (generating every
tree node), old and reference log-probs and the weight sync all come on top, so the true share is
smaller still. The paper's MATH step (32 prompts x 216 leaves, ~1,650 tokens a leaf, {step_tokens['spo_tree']:,}
training tokens) has a lower bound of {tokens.step_seconds_lower_bound(step_tokens['spo_tree']):.0f} s.
{e2e}
""")

    # Batched functions against their plain-Python references.
    rows = []
    for batch, length in maths._size(maths.REFERENCE_CHAINS, quick):
        reference, batched = maths.reference_chain_calls(batch, length)
        comparison = compare(reference, batched, repeats)
        rows.append([f"{batch} chains x {length} tokens", _ms(comparison.a_median), _ms(comparison.b_median),
                     comparison.ratio_text(1)])
        report.target(f"3. batched chain advantages vs plain-Python reference, {batch} x {length}",
                      "faster (> 1x)", comparison.ratio_text(1), comparison.ratio > 1.0)
    for trees in maths._size(maths.REFERENCE_FORESTS, quick):
        reference, batched, nodes = maths.reference_tree_calls(trees)
        comparison = compare(reference, batched, repeats)
        rows.append([f"{trees} trees 6-6-6 ({nodes} nodes)", _ms(comparison.a_median), _ms(comparison.b_median),
                     comparison.ratio_text(1)])
    report.add("3b. Batched advantage functions against their plain-Python references", f"""
The tensor functions of `spo_verl.core.algorithms.batched` against the plain-Python references they must
agree with (the chain rows are checked equal, bit for bit, before timing), the reference called row by
row (tree by tree) as a caller would.

{table(["case", "reference ms", "batched ms", "speed-up"], rows)}
""")

    # The loss.
    rows = []
    vanilla = maths.loss_call("vanilla", quick)
    for name in maths.LOSS_NAMES[1:]:
        comparison = compare(maths.loss_call(name, quick), vanilla, repeats)
        rows.append([f"`{name}`", _ms(comparison.b_median), _ms(comparison.a_median), comparison.ratio_text(),
                     f"{mem('loss/vanilla')} / {mem('loss/' + name)}"])
        hit = comparison.ratio <= LOSS_TARGET
        report.target(f"4. `{name}` vs verl `vanilla`, forward + backward", f"<= {LOSS_TARGET:g}x",
                      comparison.ratio_text(), hit, "" if hit else _loss_reason(name))
    batch, width = maths._size(maths.LOSS_BATCH, quick)
    report.add("4. Policy loss against verl's `vanilla`", f"""
Forward and backward (`loss.backward()` into the log-probs) of verl's registered losses
(`get_policy_loss_fn`) on the same tensors: one micro-batch of {batch} responses x {width} tokens (1/4 to all
of the width valid), about half of the tokens below the probability mask's p = 0.9, `token-mean`,
clip 0.2, verl's global batch info set as verl's actor sets it.

{table(["loss", "vanilla ms", "SPO ms", "SPO / vanilla", "peak MiB vanilla / SPO"], rows)}
""")

    report.add("6. Peak memory", f"""
Method: torch has no allocator statistics on the CPU, so the cases run one after the other in one fresh
subprocess (`python -m spo_workbench.benchmarks --memory-cases ...`, glibc's `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`
at 128 KiB so freed tensors leave the resident set): the case's inputs are built, it runs once, the kernel's
peak-RSS mark is reset (`/proc/self/clear_refs`), it runs again, and the figure is the peak resident set
size reached above the resident size just before that call (inputs excluded).

{table(["case", "inputs MiB", "peak MiB above inputs"], [[case, str(round(v['inputs_mib'])), str(round(v['peak_mib']))] for case, v in memory.items()])}
""")
    results["memory"] = memory
    return results


def _estimator_reason(name: str) -> str:
    return (f"`{name}` turns per-row Python metadata into tensors (one Python pass over the rows) before its "
            "tensor maths; `grpo` only groups scores by uid.")


def _loss_reason(name: str) -> str:
    if name.endswith("reference"):
        return ("the reference normalisation whitens the advantages over the masked tokens and computes the "
                "masked ratio (extra full-size tensor passes that `vanilla` does not make).")
    return "the probability mask (exp of the old log-probs, a compare and a product) comes on top of `vanilla`."


def e2e_step_times() -> str:
    """Step times of the end-to-end CPU runs from verl's file logger, if any ran here."""
    rows = []
    for path in sorted(glob.glob(os.path.join(REPO, "logs", "*", "*", "metrics-*.jsonl"))):
        times = []
        with open(path) as lines:
            for line in lines:
                try:
                    value = json.loads(line).get("data", {}).get("timing_s/step")
                except json.JSONDecodeError:
                    continue
                if value is not None:
                    times.append(float(value))
        if len(times) > 1:
            rows.append([os.path.relpath(path, REPO), len(times), f"{statistics.median(times[1:]):.1f}"])
    if not rows:
        return ("No end-to-end run's metric file (`logs/<project>/<experiment>/metrics-*.jsonl`) was found on this "
                "machine; on the tiny CPU setting a step takes seconds (README: ~4 s after the first) while "
                "its estimator batch is a few rows (microseconds).")
    return ("End-to-end CPU runs found here (median step time after the first step; their batches are a few rows, "
            "whose advantages take microseconds):\n\n" + table(["metric file", "steps", "s/step"], rows))


# ------------------------------------------------------------------------------------------------
# Rollout through verl's real rollout path
# ------------------------------------------------------------------------------------------------


def chain_section(report: Report, results: list[rollout.ChainResult]) -> None:
    rows = []
    for result in results:
        per_round = result.per_round()
        response = sum(r["response_tokens"] for r in per_round)
        mc = sum(r["mc_tokens"] for r in per_round)
        responses = result.prompts * result.n * len(per_round)
        grpo_generated = statistics.median(r["counts"].generated_tokens for r in result.grpo.rounds)
        chain_generated = statistics.median(r["counts"].generated_tokens for r in result.chain.rounds)
        rows.append([
            f"int{result.interval}", f"{result.prompts} x {result.n}",
            f"{sum(r['boundaries'] for r in per_round) / responses:.1f}",
            f"{sum(r['mc_continuations'] for r in per_round) / responses:.1f}", f"{mc / max(response, 1):.1f}",
            f"{chain_generated / max(grpo_generated, 1):.1f}x",
            f"{result.comparison.a_median:.2f}", f"{result.comparison.b_median:.2f}", result.comparison.ratio_text(1),
        ])
        report.target(f"2. SPO-chain int{result.interval}: MC cost against GRPO", "reported",
                      f"{mc / max(response, 1):.1f} continuation tokens per response token; "
                      f"{result.comparison.ratio_text(1)} GRPO's wall time per step", None)
    report.add("2. SPO-chain Monte Carlo cost against GRPO", f"""
The `spo_chain` agent loop (cutpoint partition, p < 0.9, every k-th low-probability token starts a segment,
{results[0].mc_samples if results else '-'} Monte Carlo continuations per boundary scored by verl's GSM8K scorer) against
`single_turn_agent` (what `grpo` samples) with the same `rollout.n`, through the same verl worker and server,
the model's own EOS (about 4 % per token), {rollout.RESPONSE_LENGTH}-token responses. A step here is one
rollout batch (the rest of a training step is the same for both).

{table(["interval", "prompts x n", "boundaries / response", "MC continuations / response", "continuation tokens / response token", "generated tokens vs GRPO", "SPO s/step", "GRPO s/step", "SPO / GRPO wall"], rows)}
""")


def training_tokens_section(report: Report, measured: tree_rollout.TreeResult | None) -> None:
    paper = tokens.paper_counts()
    rows = [
        ["SPO-tree 6-6-6, one row per leaf (verl today)", f"{paper['spo_tree_rows']:,}", f"{paper['spo_tree_rows'] * 32:,}"],
        ["GRPO, 216 samples of the same length", f"{paper['grpo_same_leaves']:,}", f"{paper['grpo_same_leaves'] * 32:,}"],
        ["the tree's unique tokens (each prefix once)", f"{paper['unique']:,}", f"{paper['unique'] * 32:,}"],
    ]
    ratio = paper["spo_tree_rows"] / paper["unique"]
    text = f"""
Analytic, the paper's MATH setting (prompt ~150 tokens, tree 6-6-6, segments 600 / 600 / ~300, 32 prompts
a step): every leaf row is a whole sequence, so the shared prefixes are recomputed once per leaf below them.

{table(["what the actor forwards and back-propagates", "per tree", "per step (32 prompts)"], rows)}

Per-leaf rows cost {ratio:.2f}x the unique tokens, exactly what GRPO with the same number of samples costs:
training each prefix once would cut the actor's forward/backward tokens {ratio:.2f}-fold at the paper's
setting (section 5b measures the same on the CPU rollouts; section 7 times packed training). SPO's
trainer also drops rows with no trained token (every segment is trained by one row, zero-advantage segments
are dropped), which only helps when whole leaves have nothing to train.
"""
    if measured is not None:
        case, output = measured.case, measured.tree.rounds[-1]["output"]
        tree_tokens = tree_rollout.training_rows(output)["tokens"]
        unique = tree_rollout.tree_unique_tokens(output)
        analytic = 0
        for prompt in tree_rollout.tree_prompt_lengths(output):
            budgets = aligned_budgets(prompt, case.budgets, case.align_to_block)
            analytic += tokens.per_leaf_row_tokens(prompt, case.branching, (*budgets, case.response_length - sum(budgets)))
        text += (f"\nMeasured on the CPU `spo_tree` rollout of section 1 ({case.regime}, {case.label}): {tree_tokens:,} row "
                 f"tokens for {unique:,} unique tokens ({tree_tokens / unique:.2f}x); analytic for its prompts and shape: "
                 f"{analytic:,} row tokens.\n")
        exact = measured.early_stops == 0 and tree_tokens == analytic
        report.target(f"5. training tokens per step, `spo_tree` {case.shape} (CPU rows vs analytic)",
                      "measured = analytic", f"{tree_tokens:,} rows vs {analytic:,} analytic; {unique:,} unique "
                      f"({tree_tokens / unique:.2f}x)", exact)
    report.target("5. training tokens per step, paper 6-6-6 (analytic)", "reported",
                  f"{paper['spo_tree_rows']:,} per-leaf vs {paper['unique']:,} unique per tree ({ratio:.2f}x)", None)
    report.add("5. Training tokens per step", text)


async def run_rollout(report: Report, quick: bool, repeats: int) -> tree_rollout.TreeResult | None:
    """Sections 1 and 2 on one server; returns the case section 5 measures its row tokens on (the
    largest forced-length tree)."""
    from recipe.spo.cpu_settings.tiny_model import temporary_tiny_qwen2

    with temporary_tiny_qwen2() as model_dir:
        server = await rollout.start_server(model_dir)
        try:
            cases = tree_rollout.QUICK_CASES if quick else tree_rollout.CASES
            trees = [await tree_rollout.benchmark_tree(server, model_dir, case, repeats) for case in cases]
            chain_n, mc = (2, 3) if quick else (4, 9)
            chains = [await rollout.benchmark_chain(server, model_dir, interval, rollout.PROMPTS[:1] if quick else rollout.PROMPTS[:2],
                                                    chain_n, mc, repeats) for interval in rollout.CHAIN_INTERVALS]
        finally:
            server.shutdown()
    tree_section(report, trees)
    chain_section(report, chains)
    forced = [result for result in trees if result.case.full_length]
    return max(forced, key=lambda result: result.case.leaves * result.case.prompts) if forced else None


# ------------------------------------------------------------------------------------------------
# Packed SPO-tree training through verl's actor worker
# ------------------------------------------------------------------------------------------------


def run_packing(quick: bool, repeats: int, threads: int) -> dict:
    """``python -m spo_workbench.benchmarks.packing --json`` in a fresh process (it sets up its own one-process
    torch.distributed world and the ``spo_cpu`` platform before importing verl); its JSON result."""
    command = [sys.executable, "-m", "spo_workbench.benchmarks.packing", "--json", "--threads", str(threads),
               "--repeats", str(repeats)]
    if quick:
        command.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"packed-training benchmark failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def packing_section(report: Report, results: dict) -> None:
    rows, exact, faster = [], [], []
    for shape in results["shapes"]:
        ratio = shape["row_tokens"] / shape["packed_tokens"]
        low, high = shape["speedup_spread"]
        speedup = f"{shape['speedup']:.2f}x ({low:.2f}-{high:.2f})"
        rows.append([shape["label"], f"{shape['row_tokens']:,} ({shape['rows']} rows)",
                     f"{shape['packed_tokens']:,} ({ratio:.2f}x)", _ms(shape["per_row_median_s"]),
                     _ms(shape["packed_median_s"]), speedup,
                     f"{shape['peak_mib']['per-row']:.0f} / {shape['peak_mib']['packed']:.0f}"])
        exact.append((shape, shape["packed_tokens"] == shape["unique_tokens"]
                      and shape["metric_row_tokens"] == shape["row_tokens"]))
        faster.append((shape, speedup, shape["speedup"] > 1.0))
    paper = tokens.paper_counts()
    paper_ratio = paper["spo_tree_rows"] / paper["unique"]
    rows.append(["paper 6-6-6, one tree (analytic: 150-token prompt, 600/600/300-token segments)",
                 f"{paper['spo_tree_rows']:,} (216 rows)", f"{paper['unique']:,} ({paper_ratio:.2f}x)",
                 "-", "-", "not measured (no GPU)", "-"])
    hit = all(ok for _, ok in exact)
    report.target("7. packed tokens == the batch's unique tokens (its distinct prefixes)", "equal (exact), one micro-batch",
                  "; ".join(f"{s['shape']}: {s['packed_tokens']:,} packed vs {s['unique_tokens']:,} unique "
                            f"(of {s['row_tokens']:,} row tokens)" for s, _ in exact), hit,
                  "" if hit else "the packed engine's `spo/packing/packed_tokens` metric differs from the batch's "
                  "distinct prefixes: a tree did not pack whole.")
    hit = all(ok for *_, ok in faster)
    report.target("7. actor update time falls with the tokens", "packed faster than per-row (> 1x)",
                  "; ".join(f"{s['shape']}: {text}" for s, text, _ in faster), hit,
                  "" if hit else "at this size the packed forward's fixed costs (building the packed forest, "
                  "the tree attention mask, gathering the log-probs back into rows) outweigh the saved tokens.")
    loss_diff = max(shape["loss_rel_diff"] for shape in results["shapes"])
    sweep = results.get("group_sweep") or []
    sweep_rows = [[row["label"], f"{row['packed_share']:.2f}", _ms(row["per_row_median_s"]),
                   _ms(row["packed_median_s"]),
                   f"{row['speedup']:.2f}x ({row['speedup_spread'][0]:.2f}-{row['speedup_spread'][1]:.2f})"]
                  for row in sweep]
    if sweep:
        paying = [row for row in sweep if row["speedup"] > 1.0]
        report.target("7. GRPO groups: the largest packed share where packing still pays", "reported (sets "
                      "`packing.max_token_ratio`, default 0.9)",
                      "; ".join(f"{row['packed_share']:.2f}: {row['speedup']:.2f}x" for row in sweep), None,
                      f"packing paid up to a packed share of {max(r['packed_share'] for r in paying):.2f}"
                      if paying else "packing paid at none of the measured shares")
    sweep_text = "" if not sweep else f"""

GRPO groups, where only the prompt is shared (8 responses each, the same engines and pass as above,
packing forced on for every micro-batch): the packed share is packed tokens over row tokens; the
cluster's GRPO settings (a ~150-token prompt under ~1,900-token responses) sit at about 0.93.
`algorithm.spo.packing.enable` runs verl's per-row forward for any micro-batch above
`packing.max_token_ratio` (default 0.9). These are a tiny model's proportions on a CPU; on a GPU the
crossover has not been measured.

{table(["group", "packed share", "per-row update ms", "packed update ms", "speed-up (spread)"], sweep_rows)}"""
    report.add("7. Packed SPO-tree training: one actor update pass", f"""
One actor update pass, per-leaf rows (what verl trains today) against the same batch packed
(`algorithm.spo.packing.enable`, `spo_verl.adapters.packing.engine.enable_packed_training`: each tree's
prompt and shared segments computed once, log-probs gathered back into verl's rows), through the same
engine code path as training: verl's actor `TrainingWorker` with its FSDP2 engine on the CPU (one-process
gloo world), fp32, gradient checkpointing on, verl's `ppo_loss` (`vanilla`); the model is the
{results['model']}. Two workers are built from the same model in one fresh process
(`python -m spo_workbench.benchmarks.packing`), the second switched to packed forwards. A pass is
`optimizer_zero_grad` then verl's `forward_backward_batch` in training mode (forward + backward, no
optimizer step) with the whole batch as one micro-batch, so every tree packs whole. The rows of a tree all
have the same length here (no early EOS), so the per-row side pads nothing. Speed-up = per-row / packed
time, median of {results['repeats']} alternating rounds with its spread; both sides' losses agree (largest
relative difference {loss_diff:.1g}). Packed tokens are the packed engine's own `spo/packing/packed_tokens`
metric (it must equal the batch's distinct prefixes, its unique tokens, and `spo/packing/row_tokens` the batch's row tokens, or the
run fails). Peak memory: the RSS method of section 6, both sides one after the other in one fresh
subprocess (`--memory-cases`), the peak resident set size of the pass above what the process held before
it (model and batch excluded).

{table(["shape", "row tokens", "packed tokens (row / packed)", "per-row update ms", "packed update ms", "speed-up (spread)", "peak MiB per-row / packed"], rows)}

The paper's row is the analytic count of section 5 ({paper_ratio:.2f}x fewer tokens through the actor);
its time is not measured (no GPU in this session).{sweep_text}
""")


# ------------------------------------------------------------------------------------------------
# A whole training step through verl's trainer
# ------------------------------------------------------------------------------------------------

STEP_TARGET = 0.4
CREDIT_TARGET = 0.01  # algorithm.spo.diagnostics.credit_metrics: under 1 % of a training step


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(numerator, denominator) -> float:
    return numerator / denominator if numerator is not None and denominator else float("nan")


def step_section(report: Report, result: dict) -> None:
    from spo_workbench.benchmarks.step import PACKED, PER_ROW, PHASES

    runs = {(run["algorithm"], run["configuration"]): run for run in result["runs"]}
    algorithms = list(dict.fromkeys(run["algorithm"] for run in result["runs"]))
    rows = []
    for algorithm in algorithms:
        for configuration in (PER_ROW, PACKED):
            run = runs[(algorithm, configuration)]
            tokens = run["update_tokens"]
            forwarded = ("= rows" if tokens["forwarded"] is None else
                         f"{tokens['forwarded']:,.0f} of {tokens['rows']:,.0f} ({tokens['forwarded'] / tokens['rows']:.2f})")
            updating = sum(run["updated"][1:])
            rows.append([f"`{algorithm}`", configuration, *(_seconds(run["phases"][phase]) for phase in PHASES),
                         _seconds(run["step_all"]), f"{updating} of {len(run['updated']) - 1}", forwarded,
                         f"{run['peak_memory_gib']:.1f}"])
        before, after = runs[(algorithm, PER_ROW)], runs[(algorithm, PACKED)]
        ratio = _ratio(after["phases"]["step"], before["phases"]["step"])
        ratio_all = _ratio(after["step_all"], before["step_all"])
        rows.append([f"`{algorithm}`", "**packed / per-row**", *(
            "-" if before["phases"][p] in (None, 0) or after["phases"][p] is None
            else f"{after['phases'][p] / before['phases'][p]:.2f}x" for p in PHASES), f"{ratio_all:.2f}x", "", "", ""])
        reason = ("" if ratio <= STEP_TARGET else "what is left is mostly generation, which packing does not "
                  "shorten (section 8: where the packed step's time goes)")
        report.target(f"8. `{algorithm}` training step, {result['setting']}: packed + rollout log-probs vs per-row",
                      f"<= {STEP_TARGET:g}x (median of steps 2-{result['steps']} that updated the actor)",
                      f"{ratio:.2f}x ({_seconds(after['phases']['step'])} s vs {_seconds(before['phases']['step'])} s)",
                      ratio <= STEP_TARGET, reason)
        report.target(f"8. `{algorithm}` training step, every step 2-{result['steps']}", "reported",
                      f"{ratio_all:.2f}x ({after['step_all']:.1f} s vs {before['step_all']:.1f} s)", None,
                      "steps with nothing to train (all of a prompt's samples agreed) differ between the runs")
        credit = after.get("credit_share")
        if credit is not None:
            report.target(f"8. `{algorithm}` credit metrics (`spo/credit/*`) share of a training step",
                          f"< {CREDIT_TARGET:.0%}", f"{credit:.3%} (median of steps 2-{result['steps']})",
                          credit < CREDIT_TARGET, "" if credit < CREDIT_TARGET else "reading the batch costs more than planned")
        exact = after["update_tokens"]["exact"]
        report.target(f"8. `{algorithm}` tokens forwarded per actor pass = unique tokens", "equal, every step",
                      "equal" if exact else "differ", exact,
                      "" if exact else "a micro-batch ran per row (it shared too little) or the count is wrong")
    steps = {f"{run['algorithm']} / {run['configuration']}": ", ".join(f"{t:.1f}" for t in run["step_times"])
             for run in result["runs"]}
    spreads = []
    for run in result["runs"]:
        later = [t for t in run["step_times"][1:] if t is not None]
        if later:
            spreads.append((max(later) - min(later)) / statistics.median(later))
    shares, largest = [], {}
    names = {"gen": "generation", "update_actor": "the actor update", "update_weights": "the weight sync"}
    for algorithm in algorithms:
        phases = runs[(algorithm, PACKED)]["phases"]
        share = lambda phase: _ratio(phases[phase], phases["step"])  # noqa: E731
        top = max(names, key=lambda phase: phases[phase] or 0.0)
        largest[algorithm] = f"{names[top]} ({share(top):.0%})"
        shares.append(f"`{algorithm}`: generation {share('gen'):.0%}, actor update {share('update_actor'):.0%}, "
                      f"weight sync {share('update_weights'):.0%}, old log-probs {share('old_log_prob'):.0%}")
    report.add(f"8. A whole training step of `{result['setting']}` through verl's trainer", f"""
The CPU default as a user runs it (`bash scripts/run_spo_tree.sh`, `bash scripts/run_grpo.sh`;
`python -m spo_workbench.benchmarks.step`), {result['steps']} steps per run, validation and checkpoints off,
the runs one after another in this one benchmark (A B for the first algorithm, B A for the next). A step
whose samples all agree (every SPO tree's leaves, or every GRPO group) has nothing to train and skips
the actor update; how many of a run's steps do so depends on what was sampled, so the phase columns and
the target are medians over steps 2-{result['steps']} that updated the actor (like against like), and
"step (all steps)" is the median over all of them.
"per-row" is verl's default and this project's behaviour before packing (`algorithm.spo.packing.enable=false`,
old log-probs recomputed by the actor); "packed + rollout log-probs" is what the CPU settings now run:
every micro-batch packed (each prompt, shared response prefix and few-shot preamble once) and vLLM's
float32 log-probs taken as the old log-probs (`algorithm.rollout_correction.bypass_mode=true`, so
`old_log_prob` is only verl's copy of them). Phase columns are verl's own `timing_s/*` in seconds (step
1 includes warm-up and is left out); `step` covers the whole training step (`gen` includes the reward). "forwarded" is the tokens the actor update's forwards computed against the
tokens its rows hold (`spo/packing/packed_tokens` of `spo/packing/row_tokens`); peak memory is the
machine's used memory above its level before the run (all of the run's processes, vLLM's KV cache
reserve included). One run per configuration: within a run, steps 2-{result['steps']} spread by
{min(spreads):.0%}-{max(spreads):.0%} of their median (largest minus smallest; a step whose trees all
agree skips the actor update), so a ratio is good to about that.

{table(["algorithm", "configuration", *PHASES, "step (all steps)", "steps that updated", "forwarded (share)", "peak GiB"], rows)}

Step times of every step (s): {"; ".join(f"{k}: {v}" for k, v in steps.items())}.

Where the packed step's time goes (medians): {"; ".join(shares)}. Packing and the reused log-probs remove
what was computed twice; the rest is generation (vLLM on two CPU cores, untouched by packing), the
update's forward, backward and optimizer steps on the unique tokens, and the weight sync. The largest
remaining phase ({"; ".join(f"`{a}`: {t}" for a, t in largest.items())}) is where a next factor would have
to come from.
""")


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def build_report(quick: bool, skip_rollout: bool, repeats: int, threads: int, skip_packing: bool = False,
                 step: bool = True, smollm2_rollout: bool = True) -> Report:
    report = Report()
    run_maths(report, quick, repeats, threads)
    if not skip_packing:
        packing_section(report, run_packing(quick, repeats, threads))
    if step:
        from spo_workbench.benchmarks import step as step_benchmark

        step_section(report, step_benchmark.run("cpu-smollm2", 6, ["spo_tree", "grpo"]))
    measured = None if skip_rollout else asyncio.run(run_rollout(report, quick, 1 if quick else repeats))
    if smollm2_rollout and not (quick or skip_rollout):
        tree_section(report, benchmark_smollm2_trees(repeats), "1b", SMOLLM2_MODEL)
    training_tokens_section(report, measured)
    # Sections in their numbered order.
    report.sections.sort(key=lambda section: section.split(" ", 2)[1])
    return report


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repeats, one 2-2 tree (CI)")
    parser.add_argument("--skip-rollout", action="store_true", help="no vLLM server: sections 1, 2 and 5b left out")
    parser.add_argument("--skip-packing", action="store_true", help="no verl training engine: skip section 7")
    parser.add_argument("--skip-smollm2-rollout", action="store_true",
                        help="skip section 1b (the tree rollout on SmolLM2-135M, ~60 minutes; --quick skips it too)")
    parser.add_argument("--skip-step", action="store_true",
                        help="skip section 8 (whole training steps of the CPU default, ~20 minutes; --quick skips it too)")
    parser.add_argument("--output", default=None, help="write the Markdown here (e.g. docs/BENCHMARKS.md)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (default 7, quick 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the timed maths (default 1)")
    parser.add_argument("--memory-cases", nargs="*", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_cases is not None:
        import spo_verl.register  # noqa: F401  (import verl's registries before anything is measured)
        from verl.workers.config import ActorConfig  # noqa: F401

        results = {case: measure_memory_case(maths.memory_case(case, args.quick)) for case in args.memory_cases}
        print(json.dumps(results))
        return ""
    repeats = args.repeats or (2 if args.quick else 7)
    started = time.perf_counter()
    report = build_report(args.quick, args.skip_rollout, repeats, args.threads, args.skip_packing,
                          step=not (args.quick or args.skip_step), smollm2_rollout=not args.skip_smollm2_rollout)
    command = "bash scripts/benchmark.sh " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    text = render(report, header(command.strip(), args.threads, None, time.perf_counter() - started))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        if os.path.exists(args.output):
            with open(args.output) as earlier:
                text = gpu_report.keep_gpu_rows(text, earlier.read())
        with open(args.output, "w") as out:
            out.write(text)
    print(text)
    return text
