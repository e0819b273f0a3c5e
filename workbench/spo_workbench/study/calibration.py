"""How often the CPU default's base model (SmolLM2-135M-Instruct) answers a generated task right, before
any training: the first step of choosing a task on which learning can show (a task the model already
solves leaves no headroom; one it never solves gives GRPO and SPO no signal).

    python -m spo_workbench.study.calibration [--tasks add_sub,add_sub_add,add_add,mul_add] [--problems 256] [--samples 4]
    python -m spo_workbench.study.calibration --tasks dialogue3     # a multi-turn task: its episodes played out

For each task of ``recipe.spo.cpu_settings.smollm2.TASKS``: held-out-style problems (the data's held-out seed),
the prompt the training data uses (worked examples as earlier chat turns), vLLM on the CPU with the
rollout's settings (float32, the task's ``data.max_response_length`` new tokens), scored by verl's GSM8K scorer as training scores them.
Prints greedy accuracy (what validation measures) and sampled accuracy at temperature 1 (what the
rollout sees) with standard errors over problems, pass@k, the share of problems whose k samples
disagree (where a group's advantages are not all zero), and the share of responses cut by the length
limit. The last line of stdout is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from types import SimpleNamespace

from spo_workbench.standard_error import standard_error


def _standard_error(p: float, n: int) -> float:
    return (p * (1 - p) / n) ** 0.5 if n else float("nan")


def measure(tasks: list[str], count: int, samples: int, cache: Path) -> dict:
    from transformers import AutoTokenizer
    from verl.utils.reward_score.gsm8k import compute_score
    from vllm import LLM, SamplingParams

    from recipe.spo.cpu_settings import smollm2 as cpu_smollm2

    model = cpu_smollm2.build(cache)["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              gpu_memory_utilization=0.2)
    results = {}
    for task in tasks:
        # The run's data.max_response_length on this task.
        new_tokens = cpu_smollm2.TASKS[task].response_tokens
        greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
        # No per-request seed: vLLM's CPU sampler has no seeded generators ("CPU Generator does not use offset").
        sampled = SamplingParams(temperature=1.0, n=samples, max_tokens=new_tokens)
        problems = cpu_smollm2.problems(count, cpu_smollm2.SEED + 1, task)
        prompts = [tokenizer.apply_chat_template(cpu_smollm2.messages(q, task), add_generation_prompt=True,
                                                 tokenize=False) for q, _ in problems]
        score = lambda text, answer: float(compute_score(text, str(answer)))  # noqa: E731
        greedy_out = llm.generate(prompts, greedy, use_tqdm=False)
        sampled_out = llm.generate(prompts, sampled, use_tqdm=False)
        greedy_right = [score(o.outputs[0].text, a) for o, (_, a) in zip(greedy_out, problems)]
        per_problem = [[score(c.text, a) for c in o.outputs] for o, (_, a) in zip(sampled_out, problems)]
        flat = [s for row in per_problem for s in row]
        cut = [c.finish_reason == "length" for o in sampled_out for c in o.outputs]
        g, s = sum(greedy_right) / count, sum(flat) / len(flat)
        results[task] = {
            "example": problems[0][0], "greedy_accuracy": g, "greedy_se": _standard_error(g, count),
            # Samples of one problem are not independent: the error is over the problems' own means.
            "sampled_accuracy": s, "sampled_se": standard_error([sum(row) / samples for row in per_problem]),
            f"pass_at_{samples}": sum(any(row) for row in per_problem) / count,
            "mixed_groups": sum(0 < sum(row) < samples for row in per_problem) / count,
            "truncated": sum(cut) / len(cut),
            "mean_response_tokens": sum(len(c.token_ids) for o in sampled_out for c in o.outputs) / len(cut),
        }
    return {"problems": count, "samples": samples, "tasks": results}


class _BatchedGenerate:
    """The episodes' ``generate`` over vLLM's offline engine: the requests of every episode waiting for
    a turn go to the engine as one batch (batching changes the speed, not what is sampled)."""

    def __init__(self, llm, eos_token_id: int):
        self.llm, self.eos_token_id, self.pending = llm, eos_token_id, []

    async def __call__(self, request_id: str, prompt_ids: list[int], sampling_params: dict):
        future = asyncio.get_running_loop().create_future()
        self.pending.append((prompt_ids, sampling_params, future))
        return await future

    async def serve(self, done: asyncio.Event) -> None:
        from vllm import SamplingParams, TokensPrompt

        while not done.is_set():
            for _ in range(8):  # let every episode that can reach its next turn
                await asyncio.sleep(0)
            batch, self.pending = self.pending, []
            if not batch:
                continue
            params = [SamplingParams(temperature=p["temperature"], max_tokens=p["max_tokens"],
                                     stop_token_ids=[self.eos_token_id]) for _, p, _ in batch]
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _, _ in batch], params, use_tqdm=False)
            for (_, _, future), output in zip(batch, outputs):
                future.set_result(SimpleNamespace(token_ids=list(output.outputs[0].token_ids), log_probs=None))


def play_dialogues(llm, tokenizer, task: str, rows: list[dict], temperature: float, samples: int) -> list[list[float]]:
    """Each row's dialogue played ``samples`` times against a fresh ``arithmetic_dialogue``, with the
    episode rules and reply tokens of the run's agent loops; the episodes' rewards, a list a row."""
    from spo_verl.adapters.agent_loops.episode_agent_loop import chat_reply_tokens
    from spo_verl.core.episodes.environment import environment_factory
    from spo_verl.core.episodes.episode import EpisodeRules, play
    from recipe.spo.cpu_settings import smollm2 as cpu_smollm2

    spec = cpu_smollm2.DIALOGUE_TASKS[task]
    rules = EpisodeRules(spec.operations, spec.response_tokens, {tokenizer.eos_token_id}, spec.max_turn_tokens)
    make = environment_factory("arithmetic_dialogue")
    render = lambda reply: chat_reply_tokens(tokenizer, reply.message, reply.role)  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    generate = _BatchedGenerate(llm, tokenizer.eos_token_id)

    async def one(row: dict, k: int) -> float:
        environment = make()
        environment.reset(row)
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        episode = await play(generate, f"{row['extra_info']['index']}-{k}", prompt_ids, {"temperature": temperature},
                             environment, render, decode, rules)
        return float(episode.reward or 0.0)

    async def all_rows() -> list[float]:
        done = asyncio.Event()
        server = asyncio.create_task(generate.serve(done))
        try:
            return await asyncio.gather(*(one(row, k) for row in rows for k in range(samples)))
        finally:
            done.set()
            await server

    rewards = asyncio.run(all_rows())
    return [rewards[i * samples:(i + 1) * samples] for i in range(len(rows))]


def measure_dialogues(tasks: list[str], count: int, samples: int, cache: Path) -> dict:
    """``measure`` for the multi-turn tasks: each of the task's held-out dialogues played to its end
    (greedy once, then ``samples`` times at temperature 1), scored by the environment's reward."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from recipe.spo.cpu_settings import smollm2 as cpu_smollm2
    from recipe.spo.cpu_settings.dialogue import dialogues, row

    model = cpu_smollm2.build(cache)["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0, gpu_memory_utilization=0.2)
    results = {}
    for task in tasks:
        spec = cpu_smollm2.DIALOGUE_TASKS[task]
        counts = (cpu_smollm2.TRAIN_PROBLEMS, cpu_smollm2.STUDY_HELD_OUT_PROBLEMS, cpu_smollm2.TUNE_PROBLEMS)
        held_out = dialogues(spec.operations, counts, cpu_smollm2.SEED)[1][:count]
        rows = [row(*d, "test", i, spec.examples, spec.show_work) for i, d in enumerate(held_out)]
        greedy = [r[0] for r in play_dialogues(llm, tokenizer, task, rows, 0.0, 1)]
        per_problem = play_dialogues(llm, tokenizer, task, rows, 1.0, samples)
        flat = [s for r in per_problem for s in r]
        g, s = sum(greedy) / len(rows), sum(flat) / len(flat)
        results[task] = {
            "example": rows[0]["prompt"][-1]["content"], "greedy_accuracy": g, "greedy_se": _standard_error(g, len(rows)),
            "sampled_accuracy": s, "sampled_se": standard_error([sum(r) / samples for r in per_problem]),
            f"pass_at_{samples}": sum(any(r) for r in per_problem) / len(rows),
            "mixed_groups": sum(0 < sum(r) < samples for r in per_problem) / len(rows),
        }
    return {"problems": count, "samples": samples, "tasks": results}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="add_sub,add_sub_add,add_add,mul_add")
    parser.add_argument("--problems", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=None, help="default: the run scripts' (SPO_SMOLLM2_CACHE)")
    parser.add_argument("--csv", type=Path, default=None, help="also write one row per task here")
    args = parser.parse_args(argv)
    from spo_verl.adapters.cpu_platform.environment import cpu_run_env

    os.environ.update({**cpu_run_env(), "VLLM_CPU_KVCACHE_SPACE": "2"})
    from recipe.spo.cpu_settings.smollm2 import default_cache

    from recipe.spo.cpu_settings.smollm2 import DIALOGUE_TASKS

    tasks = [t for t in args.tasks.split(",") if t]
    multi_turn = [t for t in tasks if t in DIALOGUE_TASKS]
    if multi_turn and len(multi_turn) < len(tasks):
        parser.error(f"--tasks: measure the multi-turn tasks ({', '.join(multi_turn)}) apart from the single-turn ones")
    result = (measure_dialogues if multi_turn else measure)(tasks, args.problems, args.samples, args.cache or default_cache())
    k = args.samples
    print(f"| task | example | greedy acc | sampled acc (T=1) | pass@{k} | problems with mixed samples | truncated |")
    print("|---|---|---|---|---|---|---|")
    for task, r in result["tasks"].items():
        print(f"| `{task}` | {r['example']} | {r['greedy_accuracy']:.3f} +- {r['greedy_se']:.3f} | "
              f"{r['sampled_accuracy']:.3f} +- {r['sampled_se']:.3f} | {r[f'pass_at_{k}']:.3f} | "
              f"{r['mixed_groups']:.3f} | {r.get('truncated', float('nan')):.3f} |")
    if args.csv is not None:
        write_csv(result, args.csv)
    print(json.dumps(result))
    return result


def write_csv(result: dict, path: Path) -> None:
    """One row per task: the problems and samples measured, then every figure of the table."""
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    tasks = result["tasks"]
    columns = list(next(iter(tasks.values())))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["task", "problems", "samples", *columns])
        for task, figures in tasks.items():
            writer.writerow([task, result["problems"], result["samples"], *(figures[c] for c in columns)])


if __name__ == "__main__":
    main()
