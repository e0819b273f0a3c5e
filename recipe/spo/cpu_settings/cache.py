"""A model folder and data sets built once into a cache folder (the run scripts' CPU settings).

The folder holds ``model/``, ``data/train.parquet``, ``data/val.parquet`` and a stamp with the
recipe's version: a changed recipe (a bumped version) rebuilds, anything else is reused. The command
line prints the paths as shell assignments, which ``scripts/spo_launch.sh`` evaluates.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable
from pathlib import Path


def cached_build(output_dir: str | Path, version: int, make: Callable[[Path], None]) -> dict[str, str]:
    """Paths of the model and data under ``output_dir``, calling ``make(output_dir)`` unless the stamp
    says this ``version`` is already there."""
    output_dir = Path(output_dir).expanduser().resolve()
    stamp = output_dir / "built.json"
    paths = {
        "model": str(output_dir / "model"),
        "train_files": str(output_dir / "data" / "train.parquet"),
        "val_files": str(output_dir / "data" / "val.parquet"),
    }
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == version:
        return paths
    make(output_dir)
    stamp.write_text(json.dumps({"version": version, **paths}))
    return paths


def run_cli(build: Callable[..., dict[str, str]], description: str, argv=None, tasks: tuple[str, ...] = (),
            default_task: str | None = None) -> int:
    """Print ``build``'s paths as shell assignments; a setting with several tasks takes ``--task``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    if tasks:
        parser.add_argument("--task", choices=tasks, default=default_task, help=f"default {default_task}")
    args = parser.parse_args(argv)
    paths = build(args.output_dir, args.task) if tasks else build(args.output_dir)
    for key, value in paths.items():
        print(f"{key}={shlex.quote(value)}")
    return 0
