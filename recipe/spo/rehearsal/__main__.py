"""``python -m recipe.spo.rehearsal SETTING ALGORITHM --output-dir DIR``: builds the setting's stand-ins
(once; reused from DIR) and prints, as shell assignments for ``scripts/rehearse.sh``, the model, the data
folder (``DATA_DIR``) and the substitutions as Hydra overrides; the substitutions with their reasons go
to stderr, for the person running it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from recipe.spo import REPO
from recipe.spo.rehearsal.build import FAMILIES, build, longest_prompt
from recipe.spo.rehearsal.substitutions import DERIVED, substitutions

RECIPE_CONFIG = REPO / "recipe" / "spo" / "config"


def compose_shipped(setting: str, algorithm: str, overrides: tuple[str, ...] = ()):
    """The setting and algorithm as a cluster job composes them (unresolved)."""
    from hydra import compose, initialize_config_dir

    import spo_verl.register  # noqa: F401  (the settings' resolvers)

    with initialize_config_dir(config_dir=str(RECIPE_CONFIG), version_base=None):
        return compose(config_name="spo_trainer", overrides=[f"setting={setting}", f"spo_algorithm={algorithm}", *overrides])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setting", help=f"one of {sorted(FAMILIES)}")
    parser.add_argument("algorithm")
    parser.add_argument("--output-dir", required=True, help="where the model and data are built (a cache)")
    args = parser.parse_args(argv)
    if args.setting not in FAMILIES:
        print(f"rehearsal: no rehearsal for SETTING={args.setting}; rehearsed settings: {sorted(FAMILIES)}", file=sys.stderr)
        return 2
    shipped = compose_shipped(args.setting, args.algorithm)
    template = shipped.actor_rollout_ref.model.get("custom_chat_template", None)
    built = build(args.setting, template, Path(args.output_dir))
    changes = substitutions(shipped, built["model"], longest_prompt(built["model"], built["data_dir"], template,
                                                                     shipped.data.prompt_key))
    print(f"rehearsal: {args.setting} / {args.algorithm} as shipped, but for:", file=sys.stderr)
    for change in changes:
        print(f"rehearsal:   {change.override():<70} {change.reason}", file=sys.stderr)
    print("rehearsal: and what follows them through the configuration's interpolations: "
          + ", ".join(sorted(DERIVED)), file=sys.stderr)
    print(f"rehearsal_model={shlex.quote(built['model'])}")
    print(f"rehearsal_data_dir={shlex.quote(built['data_dir'])}")
    print("rehearsal_overrides=(" + " ".join(shlex.quote(change.override()) for change in changes) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
