"""Whole training steps of a CPU setting through verl's trainer, verl's per-row default against
packed training with the rollout's log-probs as the old ones, side by side in one go.

    python -m spo_workbench.benchmarks.step --json [--setting cpu-smollm2] [--steps 4] [--algorithms spo_tree,grpo]

Each (algorithm, configuration) is one run of the project's run script, exactly as a user starts it
(``scripts/run_spo_tree.sh``, ``scripts/run_grpo.sh``), with validation and checkpoints off, so that
verl's ``timing_s/step`` is the training step alone. Runs alternate between the two configurations
(A B for the first algorithm, B A for the next, ...). Per phase the median over steps 2 and later of
verl's own timings (step 1 includes warm-up); the tokens the actor update's forwards computed against
the tokens its rows hold (``spo/packing/*``; per row these are equal); the machine's peak memory above
what it used before the run (sampled every 0.5 s: all of the run's processes, vLLM's KV cache reserve
included).

The last line of stdout is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

from spo_workbench import REPO
from recipe.spo.metrics_log import read_logged_steps

PER_ROW = "per-row (verl's default)"
PACKED = "packed + rollout log-probs"
CONFIGURATIONS = {
    PER_ROW: ["algorithm.spo.packing.enable=false", "algorithm.rollout_correction.bypass_mode=false"],
    PACKED: ["algorithm.spo.packing.enable=true", "algorithm.rollout_correction.bypass_mode=true"],
}
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "step")
SCRIPTS = {"spo_tree": "run_spo_tree.sh", "spo_chain": "run_spo_chain.sh"}  # the rest: run_grpo.sh


class PeakMemory:
    """Peak of the machine's used memory above its level at the start, sampled in a thread."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.baseline = psutil.virtual_memory().used
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, psutil.virtual_memory().used)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gib(self) -> float:
        return (self.peak - self.baseline) / 2**30


def _median_after_first(steps: list[tuple[int, dict]], key: str) -> float | None:
    values = [data[key] for step, data in steps if step >= 2 and key in data]
    return statistics.median(values) if values else None


def _updated(data: dict) -> bool:
    """Whether the step ran an actor update (an SPO-tree step whose trees all agree trains nothing)."""
    return data.get("timing_s/update_actor", 0.0) > 0.0


def run_one(algorithm: str, configuration: str, setting: str, steps: int, work: Path) -> dict:
    """One run of the run script; its per-phase medians, token counts and peak memory."""
    name = f"{algorithm}-{'packed' if configuration == PACKED else 'per_row'}"
    folder = work / name
    folder.mkdir(parents=True)
    metrics = folder / "metrics.jsonl"
    env = {**os.environ, "SETTING": setting, "TOTAL_TRAINING_STEPS": str(steps), "SAVE_FREQ": "-1",
           "TEST_FREQ": "-1", "CHECKPOINT_DIR": str(folder / "checkpoints"), "TENSORBOARD_DIR": str(folder / "tb"),
           "VERL_FILE_LOGGER_PATH": str(metrics), "EXPERIMENT_NAME": f"benchmark-{name}"}
    if algorithm not in SCRIPTS:
        env["ALGORITHM"] = algorithm
    script = REPO / "scripts" / SCRIPTS.get(algorithm, "run_grpo.sh")
    started = time.perf_counter()
    with PeakMemory() as memory, open(folder / "run.log", "w") as log:
        process = subprocess.run(["bash", str(script), *CONFIGURATIONS[configuration]], cwd=REPO, env=env,
                                 stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if process.returncode != 0:
        tail = "\n".join((folder / "run.log").read_text().splitlines()[-30:])
        raise RuntimeError(f"{name}: the run exited {process.returncode}:\n{tail}")
    logged = read_logged_steps(metrics)
    if len(logged) != steps:
        raise RuntimeError(f"{name}: {len(logged)} steps logged, {steps} asked for")
    updating = [(step, data) for step, data in logged if _updated(data)]
    phases = {phase: _median_after_first(updating, f"timing_s/{phase}") for phase in PHASES}
    row_tokens = _median_after_first(logged, "spo/packing/row_tokens")
    forwarded = _median_after_first(logged, "spo/packing/packed_tokens")
    unique = _median_after_first(logged, "spo/packing/unique_tokens")
    exact = all(data.get("spo/packing/packed_tokens") == data.get("spo/packing/unique_tokens")
                for _, data in logged if "spo/packing/packed_tokens" in data)
    return {
        "algorithm": algorithm, "configuration": configuration, "phases": phases,
        "step_all": _median_after_first(logged, "timing_s/step"),
        "step_times": [data.get("timing_s/step") for _, data in logged],
        "updated": [_updated(data) for _, data in logged],
        "update_tokens": {"forwarded": forwarded, "unique": unique, "rows": row_tokens, "exact": exact},
        "generated_tokens": _median_after_first(logged, "spo/generated_tokens"),
        # algorithm.spo.diagnostics.credit_metrics (on in the CPU settings): its seconds against the same step's.
        "credit_share": _median_after_first([(step, {"share": data["spo/credit/seconds"] / data["timing_s/step"]})
                                             for step, data in logged if "spo/credit/seconds" in data
                                             and data.get("timing_s/step")], "share"),
        "peak_memory_gib": memory.peak_gib, "wall_s": time.perf_counter() - started,
    }


def run(setting: str, steps: int, algorithms: list[str]) -> dict:
    results = []
    with tempfile.TemporaryDirectory(prefix="spo-step-benchmark-") as work:
        for index, algorithm in enumerate(algorithms):
            order = [PER_ROW, PACKED] if index % 2 == 0 else [PACKED, PER_ROW]
            for configuration in order:
                results.append(run_one(algorithm, configuration, setting, steps, Path(work)))
    return {"setting": setting, "steps": steps, "runs": results}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", default="cpu-smollm2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--algorithms", default="spo_tree,grpo")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on the last line")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 includes warm-up and is left out of the medians)")
    result = run(args.setting, args.steps, [a for a in args.algorithms.split(",") if a])
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
