"""A cluster setting's stand-ins, built locally: a tiny random model of the setting's architecture with a
tokenizer that carries the setting's special tokens, taught the setting's answer format for a few steps
(so that samples differ in reward and SPO has something to train), and raw problems in each data set's
source schema, turned into verl parquet files by ``scripts/prepare_data.sh`` as a user's would be.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from recipe.spo import REPO

VERSION = 5  # bump when what is built changes, so caches are rebuilt
SEED = 0
# Enough to learn the answer format (and to be right by chance, some in ten: rewards differ), not the sums.
FINE_TUNE_STEPS = 150
TRAIN_PROBLEMS, HELD_OUT_PROBLEMS = 64, 16
FINE_TUNED_ON = 32  # of the train problems


@dataclass(frozen=True)
class Family:
    """What the rehearsal keeps of the setting's model: its architecture and the tokens its template and
    generation use (the hub's tokenizer itself cannot be fetched here)."""

    architecture: str  # transformers config class: the same code path in verl's FSDP engine and in vLLM
    bos: str
    eos: str
    specials: tuple[str, ...]  # whole-string tokens of the template, beside BOS and EOS
    datasets: tuple[str, ...]  # prepare_data's data sets that the setting reads
    answer: str  # the answer format the model is taught: {work} and {answer} filled in
    # Sentences of deliberation before the working, where the setting's responses are long: answers that
    # reach the setting's last tree depth at the rehearsal's lengths, the model unsure where they end.
    deliberation: int = 0


FAMILIES = {
    # DeepSeek-R1-Distill-Qwen-1.5B: a Qwen2 model with DeepSeek's markers; its MATH answers end boxed.
    "math-r1-1.5b": Family("Qwen2Config", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                           ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"), ("math", "math500", "aime24"),
                           "{work}\n</think>\n\nTherefore, the final answer is: $\\boxed{{{answer}}}$. I hope it is correct", deliberation=20),
    # RhoMath-1.1B: a Llama model (TinyLlama's) with Llama's markers; its GSM8K answers end "#### n".
    "gsm8k-rhomath-1.1b": Family("LlamaConfig", "<s>", "</s>", ("<unk>",), ("gsm8k",), " {work}\n#### {answer}"),
}


def problems(count: int, seed: int) -> list[tuple[int, int, int]]:
    generator = random.Random(seed)
    return [(generator.randint(1, 20), generator.randint(1, 20), generator.randint(1, 9)) for _ in range(count)]


def question(a: int, b: int, c: int) -> str:
    return f"What is {a} + {b} - {c}?"


DELIBERATION = "Let me check the sum once more. "


def work(a: int, b: int, c: int) -> str:
    return f"{a} + {b} = {a + b}, {a + b} - {c} = {a + b - c}."


def answer(family: Family, item: tuple[int, int, int]) -> str:
    return family.answer.format(work=DELIBERATION * family.deliberation + work(*item), answer=item[0] + item[1] - item[2])


def raw_records(dataset: str, items: list[tuple[int, int, int]]) -> list[dict]:
    """Records in the source's own schema (what ``prepare_data --input-dir`` reads)."""
    if dataset == "gsm8k":
        return [{"question": question(*item), "answer": f"{work(*item)}\n#### {item[0] + item[1] - item[2]}"} for item in items]
    if dataset == "math":
        return [{"problem": question(*item), "solution": f"{work(*item)} $\\boxed{{{item[0] + item[1] - item[2]}}}$"}
                for item in items]
    return [{"problem": question(*item), "answer": str(item[0] + item[1] - item[2])} for item in items]


# Each file of each data set: its problems' seed. Held-out problems are drawn apart from the training ones.
SPLITS = {"math": {"train": SEED}, "gsm8k": {"train": SEED, "test": SEED + 1}, "math500": {"test": SEED + 2},
          "aime24": {"test": SEED + 3}}


def write_raw(folder: Path, family: Family) -> None:
    for dataset in family.datasets:
        for split, seed in SPLITS[dataset].items():
            count = TRAIN_PROBLEMS if split == "train" else HELD_OUT_PROBLEMS
            path = folder / dataset / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(record) + "\n" for record in raw_records(dataset, problems(count, seed))))


def prepare(raw: Path, data_dir: Path, family: Family) -> None:
    """The user's own command, ``scripts/prepare_data.sh``, on the raw files."""
    subprocess.run(["bash", str(REPO / "scripts" / "prepare_data.sh"), "--input-dir", str(raw), "--output-dir",
                    str(data_dir), "--datasets", ",".join(family.datasets)], check=True, stdout=sys.stderr)


def corpus(family: Family, template: str) -> list[str]:
    items = problems(TRAIN_PROBLEMS, SEED)
    texts = [question(*item) + answer(family, item) for item in items]
    return texts + [template] * 50


def build_tokenizer(folder: Path, family: Family, template: str):
    """A byte-level BPE in Qwen2's pipeline (transformers loads Qwen2 folders with it whatever is saved;
    Llama folders keep the saved one), trained on the rehearsal's text so the template's words are tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from recipe.spo.cpu_settings.tiny_model import _QWEN2_PRETOKENIZE_REGEX

    specials = list(dict.fromkeys((family.bos, family.eos, *family.specials)))
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=768, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(family, template), trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=family.bos, eos_token=family.eos,
                                      pad_token=family.eos, model_max_length=4096, clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(str(folder))
    return wrapped


def build_model(folder: Path, family: Family, tokenizer) -> None:
    """2 layers, head dimension 64 (vLLM's CPU attention needs it), untied output head as both real models."""
    import torch
    import transformers

    config_class = getattr(transformers, family.architecture)
    config = config_class(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                          tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                                            eos_token_id=tokenizer.eos_token_id,
                                                            pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(folder), safe_serialization=True)


def fine_tune(folder: Path, family: Family, template: str, steps: int = FINE_TUNE_STEPS) -> None:
    """Teacher-forced on the train problems' answers in the setting's format, rendered with its template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipe.spo.cpu_settings.tiny_model import train_on_answers

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    sequences = []
    for item in problems(TRAIN_PROBLEMS, SEED)[:FINE_TUNED_ON]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question(*item)}], add_generation_prompt=True,
                                               tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        text = answer(family, item)
        sequences.append((prompt, tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]))
    torch.manual_seed(SEED)
    train_on_answers(model, sequences, tokenizer.pad_token_id, steps)
    model.save_pretrained(str(folder), safe_serialization=True)


def longest_prompt(model: str | Path, data_dir: str | Path, template: str | None, prompt_key: str) -> int:
    """The most tokens of any prompt in ``data_dir``'s parquet files as verl renders it (the row's
    ``prompt_key`` column in the setting's template, with the generation prompt, the model's tokenizer)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    longest = 0
    for path in sorted(Path(data_dir).glob("*/*.parquet")):
        for messages in pd.read_parquet(path)[prompt_key]:
            ids = tokenizer.apply_chat_template(list(messages), chat_template=template, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            longest = max(longest, len(ids))
    return longest


def build(setting: str, template: str, output_dir: Path) -> dict[str, str]:
    """The model folder and the data folder (``DATA_DIR``) for ``setting``, reused while VERSION and the
    template are unchanged."""
    if setting not in FAMILIES:
        raise ValueError(f"no rehearsal for SETTING={setting}: the rehearsed settings are {sorted(FAMILIES)}")
    family = FAMILIES[setting]
    output_dir = Path(output_dir).expanduser().resolve() / setting
    paths = {"model": str(output_dir / "model"), "data_dir": str(output_dir / "data")}
    stamp = output_dir / "built.json"
    wanted = {"version": VERSION, "template": template}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return paths
    model = Path(paths["model"])
    model.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model, family, template)
    build_model(model, family, tokenizer)
    fine_tune(model, family, template)
    write_raw(output_dir / "raw", family)
    prepare(output_dir / "raw", Path(paths["data_dir"]), family)
    stamp.write_text(json.dumps(wanted))
    return paths
