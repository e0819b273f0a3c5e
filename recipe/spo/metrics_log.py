"""Reading verl's file logger (``trainer.logger=[..., file]``, ``VERL_FILE_LOGGER_PATH``): one JSON line
``{"step": k, "data": {metric: value}}`` per logging call; the run summary, the study and the report
read it here."""

from __future__ import annotations

import json
from pathlib import Path


def read_logged_steps(path: str | Path) -> list[tuple[int, dict]]:
    """Every logged line as ``(step, data)``, in file order. The last line of a run that is still
    writing may be unfinished: it is skipped; an unreadable line before it is an error."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not a JSON record") from None
        steps.append((int(record["step"]), record["data"]))
    return steps


def merged_by_step(path: str | Path) -> dict[int, dict]:
    """One dict per step, in step order (verl may log one step in several calls, e.g. the validation
    before training as step 0)."""
    steps: dict[int, dict] = {}
    for step, data in read_logged_steps(path):
        steps.setdefault(step, {}).update(data)
    return dict(sorted(steps.items()))
