"""One readable line per training step from verl's file logger (``trainer.logger`` with ``file``).

    python -m recipe.spo.run_summary logs/spo/<experiment>/metrics-<time>.jsonl
"""

from __future__ import annotations

import math
import sys

from recipe.spo.metrics_log import read_logged_steps

def _packed_share(data: dict):
    """Tokens the actor update's forwards computed, as a share of the tokens its rows hold."""
    rows = data.get("spo/packing/row_tokens")
    return data["spo/packing/packed_tokens"] / rows if rows else None


# (column title, metric key, key prefix, keys tried in order, or a function of the step's metrics) in
# the order printed; a column shows only if some step has it.
COLUMNS = (
    ("score", "critic/score/mean"),
    ("val acc", "val-core/"),
    ("trained tok", "spo/trained_token_fraction"),
    ("masked", "spo/prob_mask/masked_fraction"),
    ("tree gen/indep", "spo/tree/generated_over_independent"),
    ("MC tokens", "spo/chain/mc_tokens"),
    ("packed/rows", _packed_share),
    ("pg loss", "actor/pg_loss"),
    ("grad norm", "actor/grad_norm"),
    # verl's rollout-vs-actor gap, or (old log-probs taken from the rollout) the actor's first
    # mini-batch against the rollout's log-probs: both say the weight sync into vLLM is exact.
    ("probs diff max", ("training/rollout_probs_diff_max", "spo/old_log_probs/probs_diff_max")),
    ("s/step", "timing_s/step"),
)




def _value(data: dict, key):
    if callable(key):
        return key(data)
    if isinstance(key, tuple):
        return next((data[k] for k in key if k in data), None)
    if key.endswith("/"):
        matches = [v for k, v in sorted(data.items()) if k.startswith(key) and "/acc/mean@" in k]
        return matches[0] if matches else None
    return data.get(key)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan"
    if isinstance(value, float) and (abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3)):
        return f"{value:.2e}"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def summary_lines(steps: list[tuple[int, dict]]) -> list[str]:
    columns = [(title, key) for title, key in COLUMNS if any(_value(data, key) is not None for _, data in steps)]
    rows = [["step", *(title for title, _ in columns)]]
    rows += [[str(step), *(_cell(_value(data, key)) for _, key in columns)] for step, data in steps]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    steps = read_logged_steps(args[0])
    print(f"spo: summary of {len(steps)} step(s) from {args[0]}")
    for line in summary_lines(steps):
        print(f"spo: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
