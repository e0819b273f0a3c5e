"""MATH, MATH500, AIME24 and GSM8K as verl parquet files for SPO experiments.

Every row has the schema that verl's own preprocessors (``examples/data_preprocess/gsm8k.py`` and
``math_dataset.py``) write and ``verl.utils.dataset.rl_dataset.RLHFDataset`` reads:

* ``data_source``: the key ``verl.utils.reward_score.default_compute_score`` dispatches on, so verl's
  default reward path scores the row with no custom reward function (see ``DATASETS``);
* ``prompt``: ``[{"role": "user", "content": <problem> + " " + <instruction>}]``;
* ``bare_prompt``: ``[{"role": "user", "content": <problem>}]``: the problem alone, for the settings whose
  chat template writes the SPO reference's prompt around it (``data.prompt_key=bare_prompt``, the
  recipe's ``prompt_format`` configs);
* ``ability``: ``"math"``;
* ``reward_model``: ``{"style": "rule", "ground_truth": <final answer>}``;
* ``extra_info``: ``{"split", "index", "question", "answer"}``: the output split, the record's position
  in its raw split, the raw problem text and the raw text the ground truth was taken from;
* ``agent_name``: only on validation (``test``) rows and only when ``--agent-name`` is given.

Ground truths are extracted with the helpers of the scorer that will grade them (``math_reward``'s
``last_boxed_only_string``/``remove_boxed`` for MATH, ``gsm8k.extract_solution`` for GSM8K), so the
stored answer has exactly the form the scorer compares against.

Run ``python -m recipe.spo.data.prepare --help`` (or ``bash scripts/prepare_data.sh --help``).
verl is imported lazily: it takes seconds, and ``--help`` or a bad ``--datasets`` should not wait.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

VALIDATION_SPLIT = "test"  # rows of this split are validation rows (they get --agent-name)
LOCAL_EXTENSIONS = ("parquet", "jsonl", "json")
DEFAULT_OUTPUT_DIR = "~/data/spo"
SOURCES_FILE = "sources.json"  # beside the data: each data set's hub commit (or input file digest) and row counts

# EleutherAI/hendrycks_math has one config per subject; without an explicit ":CONFIG" all are loaded.
HENDRYCKS_MATH_ID = "EleutherAI/hendrycks_math"
HENDRYCKS_MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)


class PrepareDataError(ValueError):
    """A bad dataset name, a missing input file or a malformed raw record."""


@dataclass(frozen=True)
class SplitSpec:
    split: str  # output split: the file name stem and extra_info["split"]
    hub_split: str  # the split's name on the Hugging Face hub


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # CLI name and output sub-directory
    data_source: str  # default_compute_score key
    scorer: str  # the verl module default_compute_score uses for data_source (documentation)
    hub_id: str  # default hub dataset, "ID" or "ID:CONFIG"
    splits: tuple[SplitSpec, ...]


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        # verl's math_dataset.py preprocessor uses this data_source; it is scored by math_reward
        # (last \boxed{} vs ground truth, hendrycks string normalisation, 1.0 / 0.0).
        DatasetSpec(
            "math",
            "DigitalLearningGmbH/MATH-lighteval",
            "verl.utils.reward_score.math_reward",
            "DigitalLearningGmbH/MATH-lighteval",
            (SplitSpec("train", "train"),),
        ),
        # Same scorer as the MATH training set, so train and validation rewards mean the same thing.
        DatasetSpec(
            "math500",
            "HuggingFaceH4/MATH-500",
            "verl.utils.reward_score.math_reward",
            "HuggingFaceH4/MATH-500",
            (SplitSpec("test", "test"),),
        ),
        # default_compute_score sends every data_source starting with "aime" to math_dapo ("Answer: x"
        # first, else the last \boxed{} of the final 100 characters; score 1.0 / -1.0 plus "acc").
        # No MATH-style key covers AIME without merging its validation metrics into another set.
        DatasetSpec(
            "aime24",
            "aime2024",
            "verl.utils.reward_score.math_dapo",
            "HuggingFaceH4/aime_2024",
            (SplitSpec("test", "train"),),
        ),
        # verl's gsm8k.py preprocessor uses this data_source; scored by gsm8k ("#### <number>", 1 / 0).
        DatasetSpec(
            "gsm8k",
            "openai/gsm8k",
            "verl.utils.reward_score.gsm8k",
            "openai/gsm8k:main",
            (SplitSpec("train", "train"), SplitSpec("test", "test")),
        ),
    )
}
DATASET_NAMES = tuple(DATASETS)


# ---------------------------------------------------------------------------------------------
# Pure conversion: raw record -> verl row
# ---------------------------------------------------------------------------------------------


def parse_dataset_names(text: str) -> list[str]:
    """``"math,gsm8k"`` -> ``["math", "gsm8k"]``; unknown or no names raise ``PrepareDataError``."""
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in DATASETS]
    if unknown:
        raise PrepareDataError(
            f"unknown dataset name(s): {', '.join(repr(name) for name in unknown)}; "
            f"allowed names: {', '.join(DATASET_NAMES)}"
        )
    if not names:
        raise PrepareDataError(f"no dataset selected; allowed names: {', '.join(DATASET_NAMES)}")
    return names


def _field(record: Mapping[str, Any], names: Sequence[str], where: str, index: int) -> Any:
    """The first of ``names`` that ``record`` has (None counts as missing), else an error naming it."""
    for name in names:
        value = record.get(name)
        if value is not None:
            return value
    also = f" (also looked for {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    raise PrepareDataError(f"{where}: record {index} is missing field '{names[0]}'{also}")


def _text_field(record: Mapping[str, Any], names: Sequence[str], where: str, index: int) -> str:
    value = _field(record, names, where, index)
    if not isinstance(value, str) or not value.strip():
        raise PrepareDataError(
            f"{where}: record {index} field '{names[0]}' must be a non-empty string, got {value!r}"
        )
    return value


def extract_boxed_answer(solution: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of a MATH solution, by verl's own math_reward helpers."""
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(solution)
    if boxed is None:
        return None
    try:
        return remove_boxed(boxed)
    except AssertionError:  # remove_boxed asserts the "\boxed{...}" shape
        return None


def extract_gsm8k_answer(answer: str) -> str | None:
    """The number after the last ``#### `` of a GSM8K answer, by verl's own gsm8k scorer helper."""
    from verl.utils.reward_score.gsm8k import extract_solution

    return extract_solution(answer, method="strict")


def _integer_answer(value: Any) -> str:
    """AIME answers are integers 0..999; "033", 33, 33.0 all become "33" (what math_dapo compares)."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    text = str(value).strip()
    return str(int(text)) if text.isdigit() else text


def make_row(
    *,
    data_source: str,
    question: str,
    instruction: str,
    ground_truth: str,
    split: str,
    index: int,
    raw_answer: str,
    agent_name: str | None = None,
) -> dict[str, Any]:
    """One verl row in the layout of verl's gsm8k.py / math_dataset.py preprocessors."""
    row: dict[str, Any] = {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + " " + instruction}],
        "bare_prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": raw_answer},
    }
    if agent_name is not None:
        row["agent_name"] = agent_name
    return row


def _convert_extracted(record: Mapping[str, Any], split: str, index: int, agent_name: str | None, dataset: str,
                       kind: str, fields: tuple[str, str], extract: Any, missing: str) -> dict[str, Any]:
    """A record of ``kind`` (math, gsm8k) whose ground truth is extracted from its answer text
    (``fields``: question, answer); ``missing`` says what the answer lacks when ``extract`` finds none."""
    where = f"{dataset}/{split}"
    question = _text_field(record, (fields[0],), where, index)
    raw_answer = _text_field(record, (fields[1],), where, index)
    answer = extract(raw_answer)
    if answer is None:
        raise PrepareDataError(f"{where}: record {index} field '{fields[1]}' has no {missing} final answer")
    instruction = GSM8K_INSTRUCTION if kind == "gsm8k" else MATH_INSTRUCTION
    return make_row(data_source=DATASETS[kind].data_source, question=question, instruction=instruction,
                    ground_truth=answer, split=split, index=index, raw_answer=raw_answer, agent_name=agent_name)


def convert_math(record: Mapping[str, Any], split: str, index: int, agent_name: str | None = None,
                 *, dataset: str = "math") -> dict[str, Any]:
    """A MATH record (``problem``, ``solution``) -> row; the ground truth is the last ``\\boxed{}``."""
    return _convert_extracted(record, split, index, agent_name, dataset, "math", ("problem", "solution"),
                              extract_boxed_answer, "\\boxed{...}")


def convert_math500(record: Mapping[str, Any], split: str, index: int, agent_name: str | None = None,
                    *, dataset: str = "math500") -> dict[str, Any]:
    """A MATH-500 record -> row; the ground truth is its ``answer`` field, else the solution's last box."""
    where = f"{dataset}/{split}"
    problem = _text_field(record, ("problem",), where, index)
    if record.get("answer") is not None:
        raw_answer = _text_field(record, ("answer",), where, index)
        answer = raw_answer.strip()
    else:
        raw_answer = _text_field(record, ("answer", "solution"), where, index)
        answer = extract_boxed_answer(raw_answer)
        if answer is None:
            raise PrepareDataError(
                f"{where}: record {index} has no field 'answer' and its 'solution' has no \\boxed{{...}}"
            )
    return make_row(data_source=DATASETS["math500"].data_source, question=problem, instruction=MATH_INSTRUCTION,
                    ground_truth=answer, split=split, index=index, raw_answer=raw_answer, agent_name=agent_name)


def convert_aime(record: Mapping[str, Any], split: str, index: int, agent_name: str | None = None,
                 *, dataset: str = "aime24") -> dict[str, Any]:
    """An AIME record (``problem``/``Problem``, ``answer``/``Answer``) -> row with the integer answer."""
    where = f"{dataset}/{split}"
    problem = _text_field(record, ("problem", "Problem"), where, index)
    raw = _field(record, ("answer", "Answer"), where, index)
    answer = _integer_answer(raw)
    if not answer:
        raise PrepareDataError(f"{where}: record {index} field 'answer' is empty")
    return make_row(data_source=DATASETS["aime24"].data_source, question=problem, instruction=MATH_INSTRUCTION,
                    ground_truth=answer, split=split, index=index, raw_answer=str(raw), agent_name=agent_name)


def convert_gsm8k(record: Mapping[str, Any], split: str, index: int, agent_name: str | None = None,
                  *, dataset: str = "gsm8k") -> dict[str, Any]:
    """A GSM8K record (``question``, ``answer`` ending in ``#### 42``) -> row with ground truth "42"."""
    return _convert_extracted(record, split, index, agent_name, dataset, "gsm8k", ("question", "answer"),
                              extract_gsm8k_answer, "'#### <number>'")


CONVERTERS = {"math": convert_math, "math500": convert_math500, "aime24": convert_aime, "gsm8k": convert_gsm8k}


def convert_records(
    name: str, records: Iterable[Mapping[str, Any]], split: str, agent_name: str | None = None
) -> list[dict[str, Any]]:
    """All raw records of one split -> verl rows; ``agent_name`` applies to validation splits only."""
    if name not in CONVERTERS:
        parse_dataset_names(name)  # raises the "allowed names" error
    convert = CONVERTERS[name]
    row_agent = agent_name if split == VALIDATION_SPLIT else None
    rows = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise PrepareDataError(f"{name}/{split}: record {index} is not an object: {record!r}")
        rows.append(convert(record, split, index, row_agent, dataset=name))
    if not rows:
        raise PrepareDataError(f"{name}/{split}: no records")
    return rows


# ---------------------------------------------------------------------------------------------
# I/O
# ---------------------------------------------------------------------------------------------


def find_local_file(input_dir: Path, name: str, split: SplitSpec) -> Path:
    """``INPUT_DIR/NAME/SPLIT.{parquet,jsonl,json}``; the hub split's name is accepted as the stem too."""
    candidates = [
        input_dir / name / f"{stem}.{ext}"
        for stem in dict.fromkeys((split.split, split.hub_split))
        for ext in LOCAL_EXTENSIONS
    ]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(path.relative_to(input_dir)) for path in candidates)
    raise PrepareDataError(f"{name}/{split.split}: no input file in {input_dir} (looked for {looked})")


def read_local_records(path: Path) -> list[dict[str, Any]]:
    """Records of a parquet file, a JSON array, or JSON lines (``.jsonl``, or ``.json`` as HF writes it)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise PrepareDataError(f"{path}: invalid JSON: {err}") from err
        return list(records)
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise PrepareDataError(f"{path}:{lineno}: invalid JSON line: {err}") from err
    return records


def resolve_hub_revision(hub_id: str, revision: str | None) -> str:
    """The commit of the hub dataset that ``revision`` (a branch, tag or commit; None: the default branch)
    names now: what ``load_dataset`` is then given, so every split of a data set comes from one commit."""
    from huggingface_hub import HfApi

    repo = hub_id.partition(":")[0]
    return HfApi().dataset_info(repo, revision=revision).sha


def load_hub_records(hub_id: str, hub_split: str, revision: str | None = None) -> list[dict[str, Any]]:
    """Records of ``ID`` or ``ID:CONFIG`` at ``revision`` from the Hugging Face hub via ``datasets.load_dataset``."""
    import datasets

    repo, _, config = hub_id.partition(":")
    configs: Sequence[str | None] = [config or None]
    if repo == HENDRYCKS_MATH_ID and not config:
        configs = HENDRYCKS_MATH_SUBJECTS
    records: list[dict[str, Any]] = []
    for cfg in configs:
        records.extend(dict(record) for record in datasets.load_dataset(repo, cfg, split=hub_split, revision=revision))
    return records


def file_digest(path: Path) -> str:
    """A local input's identity in the sources record: its SHA-256."""
    import hashlib

    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def read_pinned_revisions(path: Path) -> dict[str, str]:
    """The hub revision of each data set in a sources record this command wrote (``--revisions-from``)."""
    try:
        sources = json.loads(path.read_text())
        return {name: entry["revision"] for name, entry in sources.items() if entry.get("hub_id")}
    except (OSError, ValueError, KeyError, AttributeError) as err:
        raise PrepareDataError(f"--revisions-from {path}: not a sources record of prepare_data ({err})") from err


def write_rows(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _dataset_table() -> str:
    lines = []
    for spec in DATASETS.values():
        files = ", ".join(f"{spec.name}/{s.split}.parquet" for s in spec.splits)
        lines.append(f"  {spec.name:8} -> {files}\n"
                     f"             data_source={spec.data_source!r} (scored by {spec.scorer}), hub: {spec.hub_id}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Write MATH (train), MATH500 (validation), AIME24 (validation) and GSM8K (train, test) as\n"
            "verl parquet files for SPO experiments. Each row's data_source is one that verl's\n"
            "default_compute_score scores, so no custom reward function is needed.\n\n"
            "Datasets:\n" + _dataset_table()
        ),
        epilog=(
            "Inputs: by default every dataset is downloaded with datasets.load_dataset from the hub id\n"
            "above (override with --<name>-id ID or ID:CONFIG; EleutherAI/hendrycks_math without a config\n"
            "loads all seven subjects). With --input-dir DIR nothing is downloaded: each split is read from\n"
            "DIR/<name>/<split>.{parquet,jsonl,json} (for aime24 DIR/aime24/train.* is accepted too), in\n"
            "the raw schema of its source: MATH problem/solution, MATH500 problem/answer (or solution),\n"
            "AIME problem/answer (or Problem/Answer), GSM8K question/answer.\n\n"
            "Validation rows and --agent-name: verl's agent loop manager runs each prompt through the\n"
            "agent loop named in the row's agent_name column and falls back to\n"
            "actor_rollout_ref.rollout.agent.default_agent_loop when the column is absent. SPO training\n"
            "sets that default to its own loop (spo_chain / spo_tree), which validation should not use;\n"
            "--agent-name single_turn_agent stores agent_name on the validation rows (the 'test' files:\n"
            "math500, aime24, gsm8k/test) so they are sampled plainly. Training rows never get the column."
        ),
    )
    parser.add_argument("--datasets", default=",".join(DATASET_NAMES),
                        help=f"comma-separated subset of: {', '.join(DATASET_NAMES)} (default: all)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"where <name>/<split>.parquet files go (default: {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--input-dir", default=None,
                        help="read raw local copies from DIR/<name>/<split>.{parquet,jsonl,json} "
                             "instead of the Hugging Face hub")
    parser.add_argument("--revisions-from", default=None, metavar="SOURCES_JSON",
                        help=f"take each hub data set at the commit a {SOURCES_FILE} written before names "
                             "(reproduces that data exactly); --<name>-revision wins over it")
    parser.add_argument("--agent-name", default=None,
                        help="agent_name column value for validation (test split) rows, e.g. "
                             "single_turn_agent; omitted by default (see below)")
    for spec in DATASETS.values():
        parser.add_argument(f"--{spec.name}-id", dest=f"{spec.name}_id", default=spec.hub_id, metavar="ID",
                            help=f"hub dataset for {spec.name}, ID or ID:CONFIG (default: {spec.hub_id})")
        parser.add_argument(f"--{spec.name}-revision", dest=f"{spec.name}_revision", default=None, metavar="REV",
                            help=f"branch, tag or commit of {spec.name}'s hub dataset (default: its default branch, "
                                 f"resolved to a commit and recorded in {SOURCES_FILE})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = parse_dataset_names(args.datasets)
    except PrepareDataError as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 2
    if args.agent_name is not None and not args.agent_name.strip():
        print("prepare_data: error: --agent-name must not be empty", file=sys.stderr)
        return 2
    output_dir = Path(args.output_dir).expanduser()
    try:
        pinned = read_pinned_revisions(Path(args.revisions_from)) if args.revisions_from else {}
        # Resolve every input before loading any, and convert everything before writing anything,
        # so a missing file or a bad record leaves no partial output behind.
        jobs = []
        sources: dict[str, dict[str, Any]] = {}
        for name in names:
            spec = DATASETS[name]
            if args.input_dir is None:
                hub_id = getattr(args, f"{name}_id")
                revision = resolve_hub_revision(hub_id, getattr(args, f"{name}_revision") or pinned.get(name))
                sources[name] = {"hub_id": hub_id, "revision": revision, "splits": {}}
            else:
                sources[name] = {"hub_id": None, "splits": {}}
            for split in spec.splits:
                if args.input_dir is not None:
                    source: Path | str = find_local_file(Path(args.input_dir).expanduser(), name, split)
                else:
                    source = sources[name]["hub_id"]
                jobs.append((spec, split, source))
        outputs = []
        for spec, split, source in jobs:
            if isinstance(source, Path):
                records = read_local_records(source)
                origin = {"file": str(source), "digest": file_digest(source)}
            else:
                revision = sources[spec.name]["revision"]
                records = load_hub_records(source, split.hub_split, revision)
                origin = {"hub_split": split.hub_split}
            rows = convert_records(spec.name, records, split.split, args.agent_name)
            # Every record becomes a row (a malformed one stops the command): nothing is filtered here.
            # verl drops prompts longer than data.max_prompt_length when it loads the rows; `--check`
            # counts them before a run.
            sources[spec.name]["splits"][split.split] = {**origin, "records": len(records), "rows": len(rows),
                                                         "dropped": len(records) - len(rows)}
            outputs.append((spec, output_dir / spec.name / f"{split.split}.parquet", rows, source))
    except PrepareDataError as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 1
    for spec, path, rows, source in outputs:
        write_rows(rows, path)
        at = f"@{sources[spec.name]['revision']}" if isinstance(source, str) else ""
        print(f"prepare_data: {len(rows)} rows from {source}{at} -> {path} (data_source={spec.data_source!r}; "
              f"{sources[spec.name]['splits'][path.stem]['dropped']} records dropped)")
    record = output_dir / SOURCES_FILE
    previous = json.loads(record.read_text()) if record.is_file() else {}
    record.write_text(json.dumps({**previous, **sources}, indent=1, sort_keys=True) + "\n")
    print(f"prepare_data: sources and revisions -> {record} (--revisions-from {record} takes the same commits again)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
