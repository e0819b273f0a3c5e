"""SPO-tree, SPO-chain, GRPO and GRPO with the probability mask trained side by side through verl's
trainer on the CPU, from the same base model, prompts and seed, to the same budget of generated
tokens (``algorithm.spo.generated_token_budget``), then one report (``python -m spo_verl.report``).

    bash scripts/compare_on_cpu.sh [--mode quick|full] [--output-dir outputs/compare-<mode>]

Each run is the project's run script (``scripts/spo_launch.sh``) with ``SETTING=cpu-smollm2``; its
console goes to ``<output-dir>/<algorithm>/console.log`` and one progress line per step is printed
here from verl's file logger as the step is logged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("spo_tree", "spo_chain", "grpo", "grpo_prob_mask")
VALIDATION_KEY_PREFIX, VALIDATION_KEY_SUFFIX = "val-core/", "/acc/mean@1"


@dataclass(frozen=True)
class Mode:
    setting: str
    generated_token_budget: int
    max_steps: int  # a bound in case a run generates far fewer tokens than expected
    test_freq: int


# quick: the whole pipeline on the embedded tiny model (four runs of about two minutes each);
# full: the real comparison on SmolLM2 (docs/RESULTS.md), about an hour on two cores. A budget ends a
# run at the step expected to reach it; max_steps bounds a run that generates far fewer tokens.
MODES = {
    "quick": Mode(setting="cpu-tiny", generated_token_budget=500, max_steps=3, test_freq=3),
    "full": Mode(setting="cpu-smollm2", generated_token_budget=5_000, max_steps=30, test_freq=3),
}


def validation_accuracy(data: dict) -> float | None:
    for key, value in sorted(data.items()):
        if key.startswith(VALIDATION_KEY_PREFIX) and key.endswith(VALIDATION_KEY_SUFFIX):
            return value
    return None


def progress_line(algorithm: str, step: int, data: dict, budget: int) -> str:
    parts = [f"compare: {algorithm:<14} step {step:>2}"]
    if "critic/score/mean" in data:
        parts.append(f"reward {data['critic/score/mean']:.3f}")
    accuracy = validation_accuracy(data)
    if accuracy is not None:
        parts.append(f"held-out acc {accuracy:.3f}")
    if "spo/generated_tokens" in data:
        parts.append(
            f"generated {data['spo/generated_tokens']:,.0f} "
            f"(total {data.get('spo/generated_tokens_cumulative', 0):,.0f} of {budget:,})"
        )
    if "timing_s/step" in data:
        parts.append(f"{data['timing_s/step']:.0f} s")
    return ", ".join(parts)


def follow(process: subprocess.Popen, metrics: Path, algorithm: str, budget: int, poll_s: float = 2.0) -> None:
    """Print a progress line for each step verl's file logger appends, until the run ends."""
    printed = 0
    while True:
        finished = process.poll() is not None
        if metrics.exists():
            lines = [line for line in metrics.read_text().splitlines() if line.strip()]
            for line in lines[printed:]:
                record = json.loads(line)
                print(progress_line(algorithm, int(record["step"]), record["data"], budget), flush=True)
            printed = len(lines)
        if finished:
            return
        time.sleep(poll_s)


def run_algorithm(algorithm: str, mode: Mode, output_dir: Path, extra_args: list[str]) -> int:
    run_dir = output_dir / algorithm
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    (run_dir / "samples.jsonl").unlink(missing_ok=True)
    env = dict(
        os.environ,
        SETTING=mode.setting,
        ALGORITHM=algorithm,
        CLUSTER_SETTING="math-r1-1.5b",
        EXPERIMENT_NAME=f"compare-{algorithm}",
        PROJECT_NAME="spo-compare",
        VERL_FILE_LOGGER_PATH=str(metrics),
        CHECKPOINT_DIR=str(run_dir / "checkpoints"),
        TENSORBOARD_DIR=str(run_dir / "tensorboard"),
        TOTAL_TRAINING_STEPS=str(mode.max_steps),
        TEST_FREQ=str(mode.test_freq),
        SAVE_FREQ="0",  # the comparison keeps no checkpoints
    )
    command = [
        "bash", str(REPO / "scripts" / "spo_launch.sh"),
        f"algorithm.spo.generated_token_budget={mode.generated_token_budget}",
        f"algorithm.spo.sample_log.dir={run_dir}",
        "trainer.val_before_train=true",  # the base model's held-out accuracy, logged as step 0
        *extra_args,
    ]
    print(f"compare: {algorithm}: training (console: {run_dir / 'console.log'})", flush=True)
    with open(run_dir / "console.log", "w") as console:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT)
        follow(process, metrics, algorithm, mode.generated_token_budget)
    if process.returncode != 0:
        print(f"compare: {algorithm} failed with exit code {process.returncode}; see {run_dir / 'console.log'}", flush=True)
    return process.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--output-dir", default=None, help="default: outputs/compare-<mode>")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma-separated subset of {list(ALGORITHMS)}")
    parser.add_argument("hydra_overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown or not algorithms:
        parser.error(f"--algorithms must be a non-empty subset of {list(ALGORITHMS)}, got {args.algorithms!r}")
    mode = MODES[args.mode]
    output_dir = Path(args.output_dir or REPO / "outputs" / f"compare-{args.mode}").resolve()
    print(
        f"compare: mode {args.mode}: {', '.join(algorithms)} on SETTING={mode.setting}, each to "
        f"{mode.generated_token_budget:,} generated tokens (at most {mode.max_steps} steps); output {output_dir}",
        flush=True,
    )
    started = time.monotonic()
    failed = [a for a in algorithms if run_algorithm(a, mode, output_dir, args.hydra_overrides) != 0]
    report_args = [sys.executable, "-m", "spo_verl.report", "--output", str(output_dir / "report"),
                   "--title", f"SPO vs GRPO on CPU ({args.mode} mode)"]
    for algorithm in algorithms:
        run_dir = output_dir / algorithm
        if (run_dir / "metrics.jsonl").exists():
            samples = run_dir / "samples.jsonl"
            report_args += ["--run", f"{algorithm}={run_dir / 'metrics.jsonl'}" + (f",{samples}" if samples.exists() else "")]
    report = subprocess.run(report_args, cwd=REPO)
    minutes = (time.monotonic() - started) / 60
    print(f"compare: done in {minutes:.1f} min; report: {output_dir / 'report' / 'report.html'}", flush=True)
    if failed:
        print(f"compare: failed runs: {', '.join(failed)}", flush=True)
    return 1 if failed or report.returncode != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
