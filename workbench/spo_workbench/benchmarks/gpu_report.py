"""The GPU check's Markdown, from its CSV alone: rows in the shape of BENCHMARKS.md's targets table
(:class:`spo_workbench.benchmarks.report.Target`), to paste there as the GPU rows, and a table of the packing
cases. Which rows are correctness checks, and their targets, are decided here too."""

from __future__ import annotations

from spo_workbench.benchmarks.report import Target, table
from spo_verl.adapters.packing.engine import PackedTrainingSettings

FP32_LOGPROB_TOLERANCE = 1e-4  # dry run: both sides in float32 (the tests see ~2e-6)
FP32_GRAD_TOLERANCE = 1e-4  # dry run: of the largest gradient (the tests see ~6e-7)
# bfloat16: packed no further from float32 than per-row, by tests/test_tree_packing_on_cpu.py's rule.
CLOSER_FACTOR, CLOSER_SLACK = 1.5, 1e-3
STEP_SHARE_TARGET = 0.01  # BENCHMARKS.md section 3
LOSS_TARGET = 1.1  # BENCHMARKS.md section 4
PACKED_MAX_TOKEN_RATIO = PackedTrainingSettings().max_token_ratio
DRY = "dry run: timing meaningless"


def _f(row: dict, column: str) -> float | None:
    return float(row[column]) if row.get(column, "") != "" else None


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _closer(row: dict, suffix: str) -> tuple[str, bool] | None:
    """With a float32 reference: packed's distance from it against per-row's."""
    a, b = _f(row, f"a_vs_fp32_{suffix}"), _f(row, f"b_vs_fp32_{suffix}")
    if a is None or b is None:
        return None
    return f"; from float32: per-row {a:.3g}, packed {b:.3g}", b <= CLOSER_FACTOR * a + CLOSER_SLACK


def _packing_targets(row: dict, dry: bool) -> list[Target]:
    name = f"7. {'dry run (CPU)' if dry else 'GPU'}, {row['label']}"
    if row["status"] != "ok":
        return [Target(name, "-", row["status"], None)]
    closer = f"packed no further from float32 than per-row (<= {CLOSER_FACTOR:g}x + {CLOSER_SLACK:g})"
    targets = []
    lp_max, lp_mean = _f(row, "logprob_max_abs_diff"), _f(row, "logprob_mean_abs_diff")
    reference = _closer(row, "logprob_max")
    measured = f"max {lp_max:.3g}, mean {lp_mean:.3g}" + (reference[0] if reference else "")
    if dry:
        targets.append(Target(f"{name}: packed vs per-row log-probs", f"equal in float32 (max <= "
                              f"{FP32_LOGPROB_TOLERANCE:g})", measured, lp_max <= FP32_LOGPROB_TOLERANCE))
    else:
        targets.append(Target(f"{name}: packed vs per-row log-probs ({row['dtype']})",
                              closer if reference else "reported", measured, reference[1] if reference else None))
    diff, scale, relative = _f(row, "grad_max_abs_diff"), _f(row, "grad_max_abs"), _f(row, "grad_rel_diff")
    reference = _closer(row, "grad_rel")
    measured = (f"relative {relative:.3g} (largest difference {diff:.3g}, largest gradient {scale:.3g})"
                + (reference[0] if reference else ""))
    if dry:
        targets.append(Target(f"{name}: packed vs per-row gradients", f"equal in float32 (largest difference <= "
                              f"{FP32_GRAD_TOLERANCE:g} x largest gradient)", measured,
                              diff <= FP32_GRAD_TOLERANCE * scale))
    else:
        targets.append(Target(f"{name}: packed vs per-row gradients ({row['dtype']})",
                              closer + " (relative)" if reference else "reported", measured,
                              reference[1] if reference else None))
    share = int(row["packed_tokens"]) / int(row["row_tokens"])
    pays = share <= PACKED_MAX_TOKEN_RATIO
    measured = (f"{_f(row, 'ratio'):.2f}x ({_f(row, 'ratio_low'):.2f}-{_f(row, 'ratio_high'):.2f}): "
                f"{_f(row, 'a_ms'):.1f} ms vs {_f(row, 'b_ms'):.1f} ms; {int(row['packed_tokens']):,} of "
                f"{int(row['row_tokens']):,} row tokens ({share:.2f}); peak {_gib(_f(row, 'a_peak_gib'))} / "
                f"{_gib(_f(row, 'b_peak_gib'))} GiB; SDPA {row['a_sdpa']} / {row['b_sdpa']}")
    target = ("packed faster than per-row (> 1x)" if pays else f"reported (packed share above "
              f"`packing.max_token_ratio` {PACKED_MAX_TOKEN_RATIO:g}: training runs it per row)")
    hit = None if dry or not pays else _f(row, "ratio") > 1.0
    reason = DRY if dry else (f"packing did not pay at a packed share of {share:.2f} (under "
                              f"`packing.max_token_ratio`, so training packs such a micro-batch)" if hit is False else "")
    targets.append(Target(f"{name}: forward + backward, per-row vs packed", target, measured, hit, reason))
    return targets


def _maths_target(row: dict, dry: bool) -> Target:
    where = "dry run (CPU)" if dry else "GPU"
    ratio = f"{_f(row, 'ratio'):.2f}x ({_f(row, 'ratio_low'):.2f}-{_f(row, 'ratio_high'):.2f})"
    if row["kind"] == "estimator":
        bound, device_ms = _f(row, "step_lower_bound_s"), _f(row, "b_ms")
        share = device_ms / 1e3 / bound
        measured = (f"{share:.3%} of a {bound:.2g} s lower bound ({row['b_side']} {device_ms:.1f} ms, peak "
                    f"{_gib(_f(row, 'b_peak_gib'))} GiB; cpu {_f(row, 'a_ms'):.1f} ms: {ratio} on the {row['b_side']})")
        hit = None if dry else share < STEP_SHARE_TARGET
        reason = DRY if dry else ("the advantages took more of the step than the target allows" if hit is False else "")
        return Target(f"3. {where}, {row['label']}: share of a training step", f"well under {STEP_SHARE_TARGET:.0%}",
                      measured, hit, reason)
    measured = f"{ratio}: {_f(row, 'a_ms'):.2f} ms vs {_f(row, 'b_ms'):.2f} ms, peak {_gib(_f(row, 'a_peak_gib'))} GiB"
    hit = None if dry else _f(row, "ratio") <= LOSS_TARGET
    reason = DRY if dry else ("the probability mask and the whitening over it are more small kernels than this "
                              "micro-batch's few milliseconds hide" if hit is False else "")
    return Target(f"4. {where}, {row['label']}", f"<= {LOSS_TARGET:g}x", measured, hit, reason)


def _failed(row: dict) -> bool:
    return row["status"].startswith("failed")


def targets(rows: list[dict]) -> list[Target]:
    dry = bool(rows) and rows[0]["dry_run"] == "1"
    found = []
    for row in rows:
        if _failed(row):
            section = "7" if row["kind"] == "packing" else "3" if row["kind"] == "estimator" else "4"
            found.append(Target(f"{section}. {'dry run (CPU)' if dry else 'GPU'}, {row['label']}", "runs",
                                "-", False, row["status"]))
        elif row["kind"] == "packing":
            found += _packing_targets(row, dry)
        else:
            found.append(_maths_target(row, dry))
    return found


def missed_checks(rows: list[dict]) -> list[str]:
    """What failed to run, and the correctness rows (log-probs, gradients) that missed their target."""
    return [t.name for t in targets(rows) if t.hit is False
            and (t.target == "runs" or "log-probs" in t.name or "gradients" in t.name)]


def render(rows: list[dict], csv_name: str, first: bool = True) -> str:
    """``first``: the section's heading; a later run recorded beside it gets a sub-heading."""
    meta = rows[0]
    dry = meta["dry_run"] == "1"
    memory = f" ({float(meta['device_memory_gib']):.0f} GiB)" if meta["device_memory_gib"] else ""
    lines = [
        ("## GPU rows" if first else f"### GPU rows: `{csv_name}`") + (" (DRY RUN)" if dry else ""),
        "",
        f"Generated by `{meta['command'].strip()}` on {meta['date']}, commit {meta['commit']}; every figure from "
        f"its `{csv_name}`.",
        "",
    ]
    if dry:
        lines += ["**Dry run on the CPU with tiny shapes (lengths / 100) in float32: it checks the shapes and that "
                  "packed equals per-row to float32 tolerance. Every timing and memory figure below is meaningless.**",
                  ""]
    lines += [
        f"* Device: {meta['device_name']}{memory}; torch {meta['torch']} (CUDA {meta['cuda']}), transformers "
        f"{meta['transformers']}; SDPA backends enabled: {meta['sdpa_enabled']}.",
        f"* Model: random {meta['model']} ({int(meta['parameters']):,} parameters), {meta['dtype']} parameters "
        f"{'' if dry else 'under bfloat16 autocast '}with float32 gradient sums, gradient checkpointing, "
        f"temperature 0.6. Whole check: {float(meta['check_seconds']):.0f} s.",
        "",
        "| measurement | target | measured | result |",
        "|---|---|---|---|",
        *(target.row() for target in targets(rows)),
        "",
    ]
    packing = [row for row in rows if row["kind"] == "packing" and row["status"] == "ok"]
    if packing:
        lines.append(table(
            ["case", "rows", "row tokens", "packed tokens (share)", "packing ms", "per-row ms", "packed ms",
             "per-row / packed", "peak GiB per-row / packed", "SDPA per-row / packed"],
            [[row["case"], row["rows"], f"{int(row['row_tokens']):,}",
              f"{int(row['packed_tokens']):,} ({int(row['packed_tokens']) / int(row['row_tokens']):.2f})",
              f"{_f(row, 'pack_ms'):.1f}", f"{_f(row, 'a_ms'):.1f}", f"{_f(row, 'b_ms'):.1f}",
              f"{_f(row, 'ratio'):.2f}x ({_f(row, 'ratio_low'):.2f}-{_f(row, 'ratio_high'):.2f})",
              f"{_gib(_f(row, 'a_peak_gib'))} / {_gib(_f(row, 'b_peak_gib'))}", f"{row['a_sdpa']} / {row['b_sdpa']}"]
             for row in packing]))
        lines.append("")
    return "\n".join(lines)


GPU_BLOCK_BEGIN = "<!-- GPU rows: recorded by `bash scripts/gpu_check.sh --record CSV`; kept when the CPU benchmark is rerun -->"
GPU_BLOCK_END = "<!-- end of the GPU rows -->"
GPU_HEADER_LINE = ("* GPU: the CPU benchmark ran without one; the section GPU rows holds the prepared GPU check's "
                   "figures, recorded from its own CSV.")


def readme_pointer(link: str) -> str:
    return f"How these runs were made, on which code, and what they show: [{link}]({link}).\n"


def gpu_block(text: str) -> str | None:
    """The recorded GPU rows in a BENCHMARKS.md text, markers included, or None."""
    start, end = text.find(GPU_BLOCK_BEGIN), text.find(GPU_BLOCK_END)
    return text[start:end + len(GPU_BLOCK_END)] if 0 <= start < end else None


def splice(benchmarks: str, rows_markdown: str) -> str:
    """BENCHMARKS.md's text with ``rows_markdown`` as its GPU rows: in place of earlier ones, else right after
    the targets table (else at the end), and the header's GPU line pointing at them."""
    block = f"{GPU_BLOCK_BEGIN}\n{rows_markdown.strip()}\n{GPU_BLOCK_END}"
    earlier = gpu_block(benchmarks)
    if earlier is not None:
        text = benchmarks.replace(earlier, block)
    else:
        targets = benchmarks.find("## Targets")
        following = benchmarks.find("\n## ", targets + 1) if targets >= 0 else -1
        text = (benchmarks[:following + 1] + block + "\n\n" + benchmarks[following + 1:] if following >= 0
                else benchmarks.rstrip("\n") + "\n\n" + block + "\n")
    lines = [GPU_HEADER_LINE if line.startswith("* GPU: ") else line for line in text.split("\n")]
    return "\n".join(lines)


def keep_gpu_rows(page: str, earlier_page: str) -> str:
    """A rerun CPU benchmark's page with the GPU rows its earlier page had recorded: a CPU run cannot
    remeasure them."""
    recorded = gpu_block(earlier_page)
    if recorded is None:
        return page
    return splice(page, recorded.removeprefix(GPU_BLOCK_BEGIN).removesuffix(GPU_BLOCK_END))
