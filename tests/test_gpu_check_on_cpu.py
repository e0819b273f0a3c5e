"""The prepared GPU check (``bash scripts/gpu_check.sh``, spo_verl/tools/benchmarks/gpu_check.py) in its dry run: the
code the GPU runs, on the CPU with tiny shapes in float32. Its rows are in the targets table's shape, its CSV
has every column and every figure of its Markdown (the Markdown re-rendered from the CSV alone is the same
text), and packed equals per-row to float32 tolerance in every case. Without a CUDA device and without
``--dry-run`` it stops at once with one line saying what it checked."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spo_verl.tools.benchmarks import gpu_report
from spo_verl.tools.benchmarks.gpu_check import COLUMNS, read_csv
from spo_verl.tools.benchmarks.gpu_packing import CASES

REPO = Path(__file__).resolve().parents[1]
HEADER = "| measurement | target | measured | result |"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("gpu_check")
    result = gpu_check("--dry-run", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    return result, output


def test_dry_run_prints_target_rows_from_its_csv(dry_run):
    result, output = dry_run
    with (output / "gpu_check.csv").open(newline="") as lines:
        assert csv.DictReader(lines).fieldnames == COLUMNS
    rows = read_csv(output / "gpu_check.csv")
    assert [row["kind"] for row in rows] == ["estimator", "estimator", "loss", *["packing"] * len(CASES)]
    assert [row["case"] for row in rows if row["kind"] == "packing"] == [case.key for case in CASES]
    assert all(row["status"] == "ok" and row["dry_run"] == "1" for row in rows)
    markdown = (output / "gpu_rows.md").read_text()
    assert markdown == gpu_report.render(rows, "gpu_check.csv")  # nothing in it but what the CSV holds
    assert markdown.strip() in result.stdout
    assert HEADER in markdown and "DRY RUN" in markdown and "meaningless" in markdown
    table = [line for line in markdown.splitlines() if line.startswith("| 3.") or line.startswith("| 4.")
             or line.startswith("| 7.")]
    assert len(table) == 3 + 3 * len(CASES)
    assert all(line.count("|") == 5 for line in table)  # measurement | target | measured | result, no stray pipe
    timing = [line for line in table if "forward + backward" in line or "share of a training step" in line]
    assert len(timing) == 3 + len(CASES)
    assert all(line.endswith("| reported dry run: timing meaningless |") for line in timing)
    checks = [line for line in table if "log-probs" in line or "gradients" in line]
    assert len(checks) == 2 * len(CASES) and all(line.endswith("| hit |") for line in checks)


def test_dry_run_packed_equals_per_row_in_float32(dry_run):
    _, output = dry_run
    for row in read_csv(output / "gpu_check.csv"):
        if row["kind"] != "packing":
            continue
        assert int(row["packed_tokens"]) < int(row["row_tokens"]), row["case"]  # a shared prompt at least
        assert float(row["logprob_max_abs_diff"]) <= gpu_report.FP32_LOGPROB_TOLERANCE, row["case"]
        assert float(row["grad_max_abs_diff"]) <= gpu_report.FP32_GRAD_TOLERANCE * float(row["grad_max_abs"])
        assert float(row["grad_max_abs"]) > 0 and float(row["a_ms"]) > 0 and float(row["b_ms"]) > 0
        assert row["a_sdpa"] not in ("", "none seen") and row["b_sdpa"] not in ("", "none seen")
        reference = [row[f"{side}_vs_fp32_{what}"] for side in "ab" for what in ("logprob_max", "grad_rel")]
        assert all(reference) if row["case"] in ("math_tree_mb", "gsm8k_grpo_mb") else not any(reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the check would run")
def test_without_a_gpu_it_stops_at_once(tmp_path):
    result = gpu_check("--output", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch.cuda.is_available() is False" in lines[0] and "--dry-run" in lines[0]
    assert not (tmp_path / "out").exists()
