"""A prepared GPU check: one short run on one borrowed GPU that measures what the CPU benchmarks cannot.

    bash scripts/gpu_check.sh [--dry-run] [--output DIR] [--whole-tree] [--share-sweep] [--time-budget SECONDS]
    bash scripts/gpu_check.sh --record docs/results/gpu_check/gpu_check.csv [MORE.csv] [--into docs/BENCHMARKS.md]

1. Packed training against per-row rows in bfloat16 on a Qwen2 of DeepSeek-R1-Distill-Qwen-1.5B's shape
   (random weights, built on the GPU: :mod:`.gpu_model`), on actor micro-batches of the cluster
   settings' SPO trees and GRPO groups (:mod:`.gpu_packing`): log-prob and gradient differences, the
   distance of each side from a float32 reference, forward + backward time, peak memory, the SDPA kernels.
2. The SPO advantage functions and the masked loss of the framework-free core on the GPU, at the batch
   sizes of BENCHMARKS.md's sections 3 and 4 (:mod:`.gpu_maths`).

Needs torch, transformers and omegaconf only (no verl, vLLM or Ray). Writes ``gpu_check.csv`` under ``--output``
(default ``outputs/gpu_check``) and renders ``gpu_rows.md`` from that CSV alone (:mod:`.gpu_report`):
rows in the shape of BENCHMARKS.md's targets table. Cases run in order of priority and one whose
predicted time no longer fits ``--time-budget`` is recorded as skipped.

``--dry-run`` runs the same code on the CPU with tiny shapes in float32 (seconds): shapes and packed ==
per-row to float32 tolerance are checked; its timings mean nothing and the output says so. Without
``--dry-run`` and without a CUDA device it stops at once. Exit status: 0, 1 when a correctness row
missed its target (the rows are written first), 2 without a CUDA device.

``--record CSV`` measures nothing: it renders a GPU run's CSV, copied under ``docs/results/``, as the GPU
rows of BENCHMARKS.md (between markers the CPU benchmark keeps when it is rerun).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib.metadata
import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path

COLUMNS = [
    "kind", "case", "setting", "label", "status", "a_side", "b_side", "a_ms", "b_ms", "ratio", "ratio_low",
    "ratio_high", "rounds", "a_peak_gib", "b_peak_gib", "step_lower_bound_s", "rows", "row_tokens",
    "packed_tokens", "pack_ms", "logprob_max_abs_diff", "logprob_mean_abs_diff", "grad_max_abs_diff",
    "grad_max_abs", "grad_rel_diff", "a_vs_fp32_logprob_max", "b_vs_fp32_logprob_max", "a_vs_fp32_grad_rel",
    "b_vs_fp32_grad_rel", "a_sdpa", "b_sdpa",
    # The run's own facts, the same on every row, so the Markdown needs nothing but the CSV.
    "command", "date", "commit", "dry_run", "device_name", "device_memory_gib", "torch", "cuda", "transformers",
    "sdpa_enabled", "model", "parameters", "dtype", "check_seconds",
]
NEEDED = ("torch", "transformers", "omegaconf")  # omegaconf: the SPO core's settings module reads OmegaConf nodes
DRY_RUN_SCALE = 100  # the dry run's lengths and budgets are the cluster's divided by this
FP32_REFERENCE_COST = 6  # a float32 token costs about this many bfloat16 ones on a GPU (for the time budget)


def _log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU in float32 (seconds)")
    parser.add_argument("--output", default="outputs/gpu_check", help="folder for gpu_check.csv and gpu_rows.md")
    parser.add_argument("--whole-tree", action="store_true",
                        help="also a whole math-r1-1.5b 6-6-6 tree as one packed micro-batch (~1.5 more minutes)")
    parser.add_argument("--time-budget", type=float, default=400.0,
                        help="seconds from the start after which no further packing case starts (default 400)")
    parser.add_argument("--share-sweep", action="store_true",
                        help="also GRPO groups at packed shares 0.5-0.95: where packing stops paying (~1 more minute)")
    parser.add_argument("--record", type=Path, nargs="+", metavar="CSV",
                        help="measure nothing: render GPU runs' gpu_check.csv files (kept under docs/results/) as "
                             "the GPU rows of --into, in the order given")
    parser.add_argument("--into", type=Path, default=Path("docs/BENCHMARKS.md"),
                        help="with --record: the benchmarks page to put the rows in (default docs/BENCHMARKS.md)")
    return parser


def record(csv_paths: list[Path], benchmarks: Path) -> int:
    """GPU runs' rows into the benchmarks page, each rendered from its CSV alone (earlier GPU rows replaced)."""
    from spo_workbench.benchmarks import gpu_report

    runs = [(path, read_csv(path)) for path in csv_paths]
    for path, rows in runs:
        if not rows or rows[0]["dry_run"] != "0":
            print(f"gpu_check: --record {path}: {'no rows' if not rows else 'a dry run'}; only a GPU run's rows "
                  f"are recorded", file=sys.stderr)
            return 2
    rendered = [gpu_report.render(rows, str(path), first=k == 0) for k, (path, rows) in enumerate(runs)]
    readme = csv_paths[0].parent / "README.md"  # how the runs were made, read beside their CSVs
    if readme.exists():
        rendered.append(gpu_report.readme_pointer(os.path.relpath(readme, benchmarks.parent)))
    benchmarks.write_text(gpu_report.splice(benchmarks.read_text(), "\n".join(rendered)))
    _log(f"recorded {sum(len(rows) for _, rows in runs)} rows of {len(runs)} run(s) in {benchmarks}")
    return 0


def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({column: _format(row.get(column)) for column in COLUMNS})


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as lines:
        return list(csv.DictReader(lines))


def _pass_tokens(case, batch) -> int:
    """What a case computes, in tokens through the model: the check pass and the timed rounds of both
    sides, and the float32 reference."""
    from spo_verl.adapters.packing.micro_batches import packed_token_count

    rows = batch.row_tokens()
    packed = packed_token_count(batch.sequences)
    reference = FP32_REFERENCE_COST * rows if case.float32_reference else 0
    return (case.rounds + 1) * (rows + packed) + reference


def packing_rows(model, cases, dtype, started: float, time_budget: float) -> list[dict]:
    from spo_workbench.benchmarks.gpu_packing import case_batch, measure_case

    device = next(model.parameters()).device
    rows, seconds, tokens = [], 0.0, 0
    for case in cases:
        batch = case_batch(case, model.config.vocab_size, device)
        kind = "leaves" if case.branching else "responses"
        label = f"{case.setting} {case.shape()}, {case.micro_batch()}: {len(batch.sequences)} {kind}"
        row = {"kind": "packing", "case": case.key, "setting": case.setting, "label": label,
               "a_side": "per-row", "b_side": "packed"}
        left = time_budget - (time.perf_counter() - started)
        predicted = seconds / tokens * _pass_tokens(case, batch) if tokens else 0.0
        if predicted > left:
            _log(f"{case.key}: skipped, predicted {predicted:.0f} s with {left:.0f} s of the time budget left")
            rows.append({**row, "status": f"skipped: predicted {predicted:.0f} s, {max(left, 0):.0f} s of the time "
                                          f"budget left"})
            continue
        case_started = time.perf_counter()
        try:
            row.update(measure_case(model, case, batch, dtype, _log), status="ok")
        except Exception as error:  # noqa: BLE001 -- one case's failure (e.g. out of memory) keeps the others' rows
            row["status"] = _failure(error)
        else:
            seconds += time.perf_counter() - case_started
            tokens += _pass_tokens(case, batch)
        _release(device)
        done = (f"per-row / packed {row['ratio']:.2f}x, log-prob max diff {row['logprob_max_abs_diff']:.3g}"
                if row["status"] == "ok" else row["status"])
        _log(f"{case.key}: {done}, {time.perf_counter() - case_started:.1f} s")
        rows.append(row)
    return rows


def _failure(error: Exception) -> str:
    _log(f"failed: {type(error).__name__}: {error}")
    return f"failed: {type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _release(device) -> None:
    """What a case (or its failure's traceback) left in the allocator's cache goes back to the device."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _meta(args, argv, device, dtype, model, started: float) -> dict:
    import torch

    from spo_workbench.benchmarks.report import _commit

    config = model.config
    cuda = device.type == "cuda"
    enabled = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                     ("memory-efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                     ("cuDNN", torch.backends.cuda.cudnn_sdp_enabled()),
                                     ("math", torch.backends.cuda.math_sdp_enabled())) if on]
    return {
        "command": "bash scripts/gpu_check.sh " + " ".join(shlex.quote(a) for a in argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(), "dry_run": int(args.dry_run),
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
        "device_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda or "-",
        "transformers": importlib.metadata.version("transformers"), "sdpa_enabled": "+".join(enabled),
        "model": (f"Qwen2, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                  f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, MLP "
                  f"{config.intermediate_size}, vocabulary {config.vocab_size:,}, untied head"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).removeprefix("torch."), "check_seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.record:
        return record(args.record, args.into)
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        print(f"gpu_check: {', '.join(missing)} not importable in {sys.executable}: the check needs "
              f"{', '.join(NEEDED)} (pip install {' '.join(missing)}; PYTHON picks another interpreter)", file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"gpu_check: torch.cuda.is_available() is False (torch {torch.__version__} at {sys.executable}): no "
              f"CUDA device to measure, nothing written; --dry-run runs the CPU check", file=sys.stderr)
        return 2
    from spo_workbench.benchmarks import gpu_maths, gpu_report
    from spo_workbench.benchmarks.gpu_model import DRY_RUN, QWEN2_1_5B, build_model
    from spo_workbench.benchmarks.gpu_packing import CASES, SHARE_SWEEP, WHOLE_TREE

    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: more threads only spin against whatever else the machine runs
    started = time.perf_counter()
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    try:
        rows = gpu_maths.measure(device, quick=args.dry_run, repeats=2 if args.dry_run else 7, log=_log)
    except Exception as error:  # noqa: BLE001 -- the packing cases still run
        rows = [{"kind": "estimator", "case": "maths", "label": "the estimators and the loss",
                 "status": _failure(error)}]
        _release(device)
    model = build_model(DRY_RUN if args.dry_run else QWEN2_1_5B, device, dtype)
    _log(f"model built ({sum(p.numel() for p in model.parameters()):,} parameters), "
         f"{time.perf_counter() - started:.1f} s")
    cases = [*CASES, *([WHOLE_TREE] if args.whole_tree else []), *(SHARE_SWEEP if args.share_sweep else ())]
    if args.dry_run:
        cases = [case.scaled(DRY_RUN_SCALE) for case in cases]
    rows += packing_rows(model, cases, dtype, started, args.time_budget)
    meta = _meta(args, argv, device, dtype, model, started)
    output = Path(args.output)
    write_csv(output / "gpu_check.csv", [{**row, **meta} for row in rows])
    recorded = read_csv(output / "gpu_check.csv")  # every figure below comes from the file
    text = gpu_report.render(recorded, "gpu_check.csv")
    (output / "gpu_rows.md").write_text(text)
    print(text)
    _log(f"wrote {output / 'gpu_check.csv'} and {output / 'gpu_rows.md'} in {meta['check_seconds']:.1f} s")
    missed = gpu_report.missed_checks(recorded)
    if missed:
        _log("correctness targets missed: " + "; ".join(missed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
