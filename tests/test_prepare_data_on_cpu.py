"""recipe.spo.data.prepare: raw MATH / MATH500 / AIME24 / GSM8K records -> verl parquet rows.

Small fixtures in the raw schema of each source are written to tmp_path, the CLI runs on them with
--input-dir (nothing is downloaded), and the parquet files are read back with pandas. Every row's
data_source/ground_truth pair is graded by verl's own default_compute_score.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipe.spo.data import prepare
from recipe.spo.data.prepare import GSM8K_INSTRUCTION, MATH_INSTRUCTION, main

REPO_ROOT = Path(__file__).resolve().parents[1]

MATH_TRAIN = [
    {"problem": "What is $1+1$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We add: $1+1=\\boxed{2}$."},
    {"problem": "Simplify $\\frac{2}{4}$.", "level": "Level 2", "type": "Algebra",
     "solution": "First $\\boxed{1}$ is wrong; dividing by 2 gives $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Find $x$ if $x^2=9$ and $x<0$.", "level": "Level 3", "type": "Algebra",
     "solution": "So $x = \\boxed{-3}$."},
]
MATH500_TEST = [
    {"problem": "Compute $\\sqrt{16}$.", "solution": "$\\sqrt{16}=\\boxed{4}$.", "answer": "4",
     "subject": "Algebra", "level": 1, "unique_id": "test/algebra/1.json"},
    {"problem": "Write $0.5$ as a fraction.", "solution": "It is $\\boxed{\\frac12}$.", "answer": "\\frac{1}{2}",
     "subject": "Prealgebra", "level": 2, "unique_id": "test/prealgebra/2.json"},
]
# Maxwell-Jia/AIME_2024 schema (capitalised fields, integer answers), stored under the hub split name.
AIME_TRAIN = [
    {"ID": "2024-I-1", "Problem": "Find the remainder when $2024$ is divided by $1000$.",
     "Solution": "It is 24.", "Answer": 24},
    {"ID": "2024-I-2", "Problem": "Compute $10^2+4$.", "Solution": "104.", "Answer": 104},
]
GSM8K_TRAIN = [
    {"question": "Tom has 40 apples and buys 2 more. How many apples does he have?",
     "answer": "40 + 2 = <<40+2=42>>42\n#### 42"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?",
     "answer": "1,000 * 2 = <<1000*2=2000>>2,000\n#### 2,000"},
]
GSM8K_TEST = [
    {"question": "Ann owes $5 and pays $8. What change does she get?", "answer": "8 - 5 = 3\n#### 3"},
]


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def _write_parquet(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    _write_jsonl(raw / "math" / "train.jsonl", MATH_TRAIN)
    _write_parquet(raw / "math500" / "test.parquet", MATH500_TEST)
    _write_parquet(raw / "aime24" / "train.parquet", AIME_TRAIN)
    _write_jsonl(raw / "gsm8k" / "train.jsonl", GSM8K_TRAIN)
    _write_jsonl(raw / "gsm8k" / "test.json", GSM8K_TEST)  # JSON lines in .json, as datasets.to_json writes
    return raw


def _read(path: Path) -> list[dict]:
    assert path.is_file(), path
    return pd.read_parquet(path).to_dict(orient="records")


def _expected(data_source, question, instruction, ground_truth, split, index, raw_answer, agent_name=None):
    row = {
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


def _plain(row: dict) -> dict:
    """pandas gives the prompt list back as a numpy array; compare as plain lists."""
    return {**row, **{key: [dict(message) for message in row[key]] for key in ("prompt", "bare_prompt")}}


def _expected_files(agent_name=None):
    return {
        "math/train.parquet": [
            _expected("DigitalLearningGmbH/MATH-lighteval", r["problem"], MATH_INSTRUCTION, gt, "train", i,
                      r["solution"])
            for i, (r, gt) in enumerate(zip(MATH_TRAIN, ["2", "\\frac{1}{2}", "-3"]))
        ],
        "math500/test.parquet": [
            _expected("HuggingFaceH4/MATH-500", r["problem"], MATH_INSTRUCTION, r["answer"], "test", i,
                      r["answer"], agent_name)
            for i, r in enumerate(MATH500_TEST)
        ],
        "aime24/test.parquet": [
            _expected("aime2024", r["Problem"], MATH_INSTRUCTION, str(r["Answer"]), "test", i, str(r["Answer"]),
                      agent_name)
            for i, r in enumerate(AIME_TRAIN)
        ],
        "gsm8k/train.parquet": [
            _expected("openai/gsm8k", r["question"], GSM8K_INSTRUCTION, gt, "train", i, r["answer"])
            for i, (r, gt) in enumerate(zip(GSM8K_TRAIN, ["42", "2000"]))
        ],
        "gsm8k/test.parquet": [
            _expected("openai/gsm8k", r["question"], GSM8K_INSTRUCTION, "3", "test", i, r["answer"], agent_name)
            for i, r in enumerate(GSM8K_TEST)
        ],
    }


@pytest.mark.parametrize("agent_name", [None, "single_turn_agent"])
def test_all_datasets_exact_rows(raw_dir, tmp_path, capsys, agent_name):
    out = tmp_path / "out"
    argv = ["--input-dir", str(raw_dir), "--output-dir", str(out)]
    if agent_name:
        argv += ["--agent-name", agent_name]
    assert main(argv) == 0
    assert "aime24/test.parquet" in capsys.readouterr().out

    expected = _expected_files(agent_name)
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet"))
    assert written == sorted(expected)
    for rel, rows in expected.items():
        frame = pd.read_parquet(out / rel)
        columns = ["data_source", "prompt", "bare_prompt", "ability", "reward_model", "extra_info"]
        if agent_name and rel.endswith("test.parquet"):
            columns.append("agent_name")  # validation rows only
        assert list(frame.columns) == columns, rel
        assert [_plain(row) for row in _read(out / rel)] == rows, rel


def test_prompt_and_ground_truth_text(raw_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out), "--datasets", "math,gsm8k"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k", "math", "sources.json"]
    math_row = _read(out / "math" / "train.parquet")[1]
    assert math_row["prompt"][0]["content"] == (
        "Simplify $\\frac{2}{4}$. Let's think step by step and output the final answer within \\boxed{}."
    )
    assert math_row["reward_model"]["ground_truth"] == "\\frac{1}{2}"  # the last box, nested braces kept
    gsm_row = _read(out / "gsm8k" / "train.parquet")[1]
    assert gsm_row["prompt"][0]["content"] == (
        "A shop sells 1,000 pens a day. How many in 2 days? "
        "Let's think step by step and output the final answer after \"####\"."
    )
    assert gsm_row["reward_model"]["ground_truth"] == "2000"
    assert _read(out / "gsm8k" / "train.parquet")[0]["reward_model"]["ground_truth"] == "42"


def _correct_and_wrong(row: dict) -> tuple[str, str]:
    gt = row["reward_model"]["ground_truth"]
    if row["data_source"] == "openai/gsm8k":
        return f"Adding up step by step.\n#### {gt}", "Adding up step by step.\n#### 999999"
    return f"Working it out, the result is $\\boxed{{{gt}}}$.", "Working it out, the result is $\\boxed{999999}$."


def _score(value) -> float:
    return float(value["score"]) if isinstance(value, dict) else float(value)


def test_default_compute_score_round_trip(raw_dir, tmp_path):
    from verl.utils.reward_score import default_compute_score

    out = tmp_path / "out"
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out)]) == 0
    failure_value = {"openai/gsm8k": 0.0, "DigitalLearningGmbH/MATH-lighteval": 0.0,
                     "HuggingFaceH4/MATH-500": 0.0, "aime2024": -1.0}  # math_dapo scores wrong answers -1
    seen = set()
    for path in sorted(out.rglob("*.parquet")):
        for row in _read(path):
            correct, wrong = _correct_and_wrong(row)
            gt = row["reward_model"]["ground_truth"]
            assert _score(default_compute_score(row["data_source"], correct, gt)) == 1.0, (path, row)
            assert _score(default_compute_score(row["data_source"], wrong, gt)) == failure_value[row["data_source"]]
            seen.add(row["data_source"])
    assert seen == set(failure_value)


def test_verl_rl_dataset_reads_the_files(raw_dir, tmp_path, monkeypatch):
    """verl's own RLHFDataset loads the train file and the validation files together (one schema)."""
    import datasets
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from recipe.spo.cpu_settings.tiny_model import build_tiny_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    out = tmp_path / "out"
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out), "--agent-name", "single_turn_agent"]) == 0
    tokenizer = build_tiny_tokenizer(tmp_path / "tok")
    config = OmegaConf.create({"cache_dir": str(tmp_path / "verl_cache"), "max_prompt_length": 512,
                               "filter_overlong_prompts": False})
    train = RLHFDataset([str(out / "math" / "train.parquet")], tokenizer, config)
    assert len(train) == len(MATH_TRAIN)
    assert "agent_name" not in train[0]  # training rows run SPO's default agent loop
    val_files = [str(out / rel) for rel in ("math500/test.parquet", "aime24/test.parquet", "gsm8k/test.parquet")]
    val = RLHFDataset(val_files, tokenizer, config)
    items = [val[i] for i in range(len(val))]
    sources = ["HuggingFaceH4/MATH-500"] * 2 + ["aime2024"] * 2 + ["openai/gsm8k"]
    assert [item["data_source"] for item in items] == sources
    assert {item["agent_name"] for item in items} == {"single_turn_agent"}
    assert [item["index"] for item in items] == [0, 1, 0, 1, 0]  # from extra_info["index"]
    assert items[2]["raw_prompt"] == [{"role": "user", "content": AIME_TRAIN[0]["Problem"] + " " + MATH_INSTRUCTION}]


def test_math500_and_aime_alternative_schemas(tmp_path):
    raw = tmp_path / "raw"
    # MATH500 copy without an answer column: the ground truth comes from the solution's last box.
    _write_jsonl(raw / "math500" / "test.jsonl", [{"problem": "P", "solution": "so $\\boxed{7}$"}])
    # HuggingFaceH4/aime_2024 schema (lower-case fields, string answers, zero-padded) as a JSON array.
    aime = [{"id": 60, "problem": "Q", "solution": "S", "answer": "033", "url": "u", "year": "2024"}]
    (raw / "aime24").mkdir(parents=True)
    (raw / "aime24" / "test.json").write_text(json.dumps(aime), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["--input-dir", str(raw), "--output-dir", str(out), "--datasets", "math500,aime24"]) == 0
    assert _read(out / "math500" / "test.parquet")[0]["reward_model"]["ground_truth"] == "7"
    aime_row = _read(out / "aime24" / "test.parquet")[0]
    assert aime_row["reward_model"]["ground_truth"] == "33"
    assert aime_row["extra_info"]["answer"] == "033"


def test_unknown_dataset_fails_before_loading(tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("nothing may be loaded for a bad --datasets")

    monkeypatch.setattr(prepare, "load_hub_records", no_loading)
    monkeypatch.setattr(prepare, "read_local_records", no_loading)
    monkeypatch.setattr(prepare, "find_local_file", no_loading)
    assert main(["--datasets", "math,aime25,gsm8k", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset name(s): 'aime25'" in err
    assert "allowed names: math, math500, aime24, gsm8k" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(prepare.PrepareDataError, match="allowed names"):
        prepare.convert_records("mathh", [], "train")


def test_missing_field_names_dataset_index_and_field(raw_dir, tmp_path, capsys):
    _write_jsonl(raw_dir / "gsm8k" / "test.json", [GSM8K_TEST[0], {"question": "No answer here?"}])
    out = tmp_path / "out"
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "gsm8k/test: record 1 is missing field 'answer'" in err
    assert not out.exists()  # everything is converted before anything is written

    with pytest.raises(prepare.PrepareDataError, match=r"aime24/test: record 4 is missing field 'problem'"):
        prepare.convert_aime({"answer": "1"}, "test", 4)
    with pytest.raises(prepare.PrepareDataError, match=r"math/train: record 2 field 'solution' has no \\boxed"):
        prepare.convert_math({"problem": "p", "solution": "no box"}, "train", 2)
    with pytest.raises(prepare.PrepareDataError, match=r"gsm8k/train: record 0 field 'answer' has no '#### "):
        prepare.convert_gsm8k({"question": "q", "answer": "42"}, "train", 0)


def test_missing_input_file(tmp_path, capsys):
    (tmp_path / "raw").mkdir()
    assert main(["--input-dir", str(tmp_path / "raw"), "--datasets", "math500"]) == 1
    err = capsys.readouterr().err
    assert "math500/test: no input file" in err and "math500/test.parquet" in err


def test_hub_loading_uses_ids_configs_and_splits(tmp_path, monkeypatch):
    import datasets

    calls = []
    raw = {("openai/gsm8k", "main", "train"): GSM8K_TRAIN, ("openai/gsm8k", "main", "test"): GSM8K_TEST,
           ("HuggingFaceH4/aime_2024", None, "train"): AIME_TRAIN}

    def fake_load_dataset(path, name=None, split=None, revision=None):
        calls.append((path, name, split))
        assert revision == f"commit-of-{path}"  # every split of a data set from the one resolved commit
        if path == prepare.HENDRYCKS_MATH_ID:
            return [MATH_TRAIN[0]]
        return raw[(path, name, split)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(prepare, "resolve_hub_revision", lambda hub_id, revision: f"commit-of-{hub_id.partition(':')[0]}")
    out = tmp_path / "out"
    assert main(["--output-dir", str(out), "--datasets", "gsm8k,aime24,math",
                 "--math-id", prepare.HENDRYCKS_MATH_ID, "--agent-name", "single_turn_agent"]) == 0
    assert calls[:3] == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test"),
                         ("HuggingFaceH4/aime_2024", None, "train")]
    subjects = prepare.HENDRYCKS_MATH_SUBJECTS
    assert calls[3:] == [(prepare.HENDRYCKS_MATH_ID, subject, "train") for subject in subjects]
    assert len(_read(out / "math" / "train.parquet")) == len(prepare.HENDRYCKS_MATH_SUBJECTS)
    assert "agent_name" not in _read(out / "gsm8k" / "train.parquet")[0]
    assert _read(out / "gsm8k" / "test.parquet")[0]["agent_name"] == "single_turn_agent"
    assert [r["extra_info"]["split"] for r in _read(out / "aime24" / "test.parquet")] == ["test", "test"]


def test_shell_wrapper_help():
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "prepare_data.sh"), "--help"],
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert "--agent-name" in result.stdout and "single_turn_agent" in result.stdout
    for name in prepare.DATASET_NAMES:
        assert name in result.stdout


def test_the_sources_record_names_each_input_and_what_was_dropped(raw_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out), "--datasets", "gsm8k"]) == 0
    sources = json.loads((out / "sources.json").read_text())
    train = raw_dir / "gsm8k" / "train.jsonl"
    assert sources["gsm8k"]["hub_id"] is None
    assert sources["gsm8k"]["splits"]["train"] == {
        "file": str(train), "digest": "sha256:" + hashlib.sha256(train.read_bytes()).hexdigest(),
        "records": len(GSM8K_TRAIN), "rows": len(GSM8K_TRAIN), "dropped": 0}
    assert f"{len(GSM8K_TRAIN)} rows from {train} -> " in capsys.readouterr().out
    # A later run for another data set keeps what the record said of the first.
    assert main(["--input-dir", str(raw_dir), "--output-dir", str(out), "--datasets", "math"]) == 0
    assert set(json.loads((out / "sources.json").read_text())) == {"gsm8k", "math"}


def test_hub_data_sets_are_taken_at_one_recorded_commit_and_can_be_taken_there_again(tmp_path, monkeypatch):
    """No hub here: the two hub calls are replaced, and what they are asked is checked."""
    asked = []

    def resolve(hub_id, revision):
        asked.append(("resolve", hub_id, revision))
        return revision if revision and len(revision) == 40 else "c" * 40

    def load(hub_id, hub_split, revision=None):
        asked.append(("load", hub_id, hub_split, revision))
        return GSM8K_TRAIN if hub_split == "train" else GSM8K_TEST

    monkeypatch.setattr(prepare, "resolve_hub_revision", resolve)
    monkeypatch.setattr(prepare, "load_hub_records", load)
    out = tmp_path / "out"
    assert main(["--output-dir", str(out), "--datasets", "gsm8k"]) == 0
    assert asked == [("resolve", "openai/gsm8k:main", None), ("load", "openai/gsm8k:main", "train", "c" * 40),
                     ("load", "openai/gsm8k:main", "test", "c" * 40)]
    record = out / "sources.json"
    assert json.loads(record.read_text())["gsm8k"]["revision"] == "c" * 40
    asked.clear()
    (out / "sources.json").write_text(json.dumps({"gsm8k": {"hub_id": "openai/gsm8k:main", "revision": "a" * 40}}))
    assert main(["--output-dir", str(tmp_path / "again"), "--datasets", "gsm8k", "--revisions-from", str(record)]) == 0
    assert asked[0] == ("resolve", "openai/gsm8k:main", "a" * 40) and asked[1][-1] == "a" * 40
    asked.clear()
    assert main(["--output-dir", str(tmp_path / "third"), "--datasets", "gsm8k", "--revisions-from", str(record),
                 "--gsm8k-revision", "b" * 40]) == 0
    assert asked[0] == ("resolve", "openai/gsm8k:main", "b" * 40)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["--output-dir", str(tmp_path / "x"), "--revisions-from", str(bad)]) == 1
