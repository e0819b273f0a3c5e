"""The prepared GPU check (``bash scripts/gpu_check.sh``, workbench/spo_workbench/benchmarks/gpu_check.py) in its dry run: the
code the GPU runs, on the CPU with tiny shapes in float32. Its rows are in the targets table's shape, its CSV
has every column and every figure of its Markdown (the Markdown re-rendered from the CSV alone is the same
text), and packed equals per-row to float32 tolerance in every case. Without a CUDA device and without
``--dry-run`` it stops at once with one line saying what it checked."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spo_workbench.benchmarks import gpu_report
from spo_workbench.benchmarks.gpu_check import COLUMNS, read_csv
from spo_workbench.benchmarks.gpu_packing import CASES

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


RECORDED = sorted((REPO / "docs" / "results" / "gpu_check").glob("*.csv"))


def test_benchmarks_page_holds_exactly_the_recorded_gpu_runs():
    """BENCHMARKS.md's GPU rows are the recorded GPU runs' CSVs rendered (``--record
    docs/results/gpu_check/*.csv``), nothing added by hand."""
    assert [path.name for path in RECORDED] == ["gpu_check.csv", "h100_run.csv", "share_sweep.csv", "third_run.csv"]
    runs = [(path.relative_to(REPO), read_csv(path)) for path in RECORDED]
    assert all(rows and all(row["dry_run"] == "0" for row in rows) for _, rows in runs)
    page = (REPO / "docs" / "BENCHMARKS.md").read_text()
    block = gpu_report.gpu_block(page)
    assert block is not None
    rendered = [gpu_report.render(rows, str(path), first=k == 0) for k, (path, rows) in enumerate(runs)]
    rendered.append(gpu_report.readme_pointer("results/gpu_check/README.md"))  # the runs' provenance beside them
    assert block.removeprefix(gpu_report.GPU_BLOCK_BEGIN).removesuffix(gpu_report.GPU_BLOCK_END).strip() == \
        "\n".join(rendered).strip()
    assert (REPO / "docs" / "results" / "gpu_check" / "README.md").exists()
    assert gpu_report.GPU_HEADER_LINE in page.splitlines()
    misses = [line for line in block.splitlines() if "| **MISS**" in line]
    assert misses and all(re.search(r"\| \*\*MISS\*\* \S.* \|$", line) for line in misses), "a miss needs its reason"


def test_record_puts_the_rows_after_the_targets_and_replaces_earlier_ones(dry_run, tmp_path):
    _, output = dry_run
    page = tmp_path / "BENCHMARKS.md"
    original = "# Benchmarks\n\n* GPU: none lent.\n\n## Targets\n\n| a |\n\n## 1. Rollout\n\ntext\n"
    page.write_text(original)
    # A dry run's rows are refused: its timings mean nothing.
    refused = gpu_check("--record", str(output / "gpu_check.csv"), "--into", str(page))
    assert refused.returncode == 2 and "dry run" in refused.stderr and page.read_text() == original
    gpu_run = tmp_path / "gpu_check.csv"
    rows = [{**row, "dry_run": "0", "device_memory_gib": "139.8"} for row in read_csv(output / "gpu_check.csv")]
    from spo_workbench.benchmarks.gpu_check import write_csv
    write_csv(gpu_run, rows)
    for _ in range(2):  # recording twice leaves one block
        result = gpu_check("--record", str(gpu_run), "--into", str(page))
        assert result.returncode == 0, result.stderr
    text = page.read_text()
    assert text.count(gpu_report.GPU_BLOCK_BEGIN) == 1 and text.count("## GPU rows") == 1
    # Two runs recorded together: the second under its own heading, named by its CSV.
    assert gpu_check("--record", str(gpu_run), str(gpu_run), "--into", str(page)).returncode == 0
    block = gpu_report.gpu_block(page.read_text())
    assert block.count("## GPU rows\n") == 1 and block.count(f"### GPU rows: `{gpu_run}`") == 1
    assert gpu_check("--record", str(gpu_run), "--into", str(page)).returncode == 0
    assert page.read_text() == text
    assert text.index("## Targets") < text.index("## GPU rows") < text.index("## 1. Rollout")
    assert "* GPU: none lent." not in text and gpu_report.GPU_HEADER_LINE in text
    # The CPU benchmark, rerun, writes its own page and keeps the recorded rows.
    cpu_page = "# Benchmarks\n\n* GPU: none lent.\n\n## Targets\n\n| b |\n"
    rerun = gpu_report.keep_gpu_rows(cpu_page, text)
    assert gpu_report.gpu_block(rerun) == gpu_report.gpu_block(text) and "| b |" in rerun
    assert gpu_report.GPU_HEADER_LINE in rerun and gpu_report.keep_gpu_rows(cpu_page, original) == cpu_page


def test_share_sweep_puts_grpo_groups_at_each_packed_share(tmp_path):
    from spo_workbench.benchmarks.gpu_packing import SHARE_SWEEP, SWEEP_RESPONSE, SWEEP_SHARES, sweep_prompt

    # The prompt lengths give the shares (on the GPU: 1,024-token responses, eight a group).
    for share, case in zip(SWEEP_SHARES, SHARE_SWEEP, strict=True):
        rows, prompt = case.rows, sweep_prompt(share)
        assert (case.prompt, case.segments) == (prompt, (SWEEP_RESPONSE,))
        assert (prompt + rows * SWEEP_RESPONSE) / (rows * (prompt + SWEEP_RESPONSE)) == pytest.approx(share, abs=5e-4)
    result = gpu_check("--dry-run", "--share-sweep", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    swept = [row for row in read_csv(tmp_path / "gpu_check.csv") if row["case"].startswith("grpo_share_")]
    assert [row["case"] for row in swept] == [case.key for case in SHARE_SWEEP]
    assert all(row["status"] == "ok" and int(row["rows"]) == 8 for row in swept)
    shares = [int(row["packed_tokens"]) / int(row["row_tokens"]) for row in swept]
    # The dry run's lengths are the GPU's / 100 (a prompt of at least 2 tokens, so the last shares coincide).
    assert shares == sorted(shares) and shares[0] < 0.6 < 0.8 < shares[-1]


def test_a_missing_package_is_named_before_anything_runs(tmp_path):
    """A GPU machine's Python without omegaconf (as the H200 the check first ran on): one line naming it."""
    script = ("import sys; sys.modules['omegaconf'] = None; import importlib.util as u; real = u.find_spec; "
              "u.find_spec = lambda name, *a: None if name == 'omegaconf' else real(name, *a); "
              "from spo_workbench.benchmarks.gpu_check import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, "--dry-run", "--output", str(tmp_path / "out")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: omegaconf not importable") and "pip install omegaconf" in lines[0]
    assert not (tmp_path / "out").exists()
