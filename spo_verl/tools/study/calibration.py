"""How often the CPU default's base model (SmolLM2-135M-Instruct) answers a generated task right, before
any training: the first step of choosing a task on which learning can show (a task the model already
solves leaves no headroom; one it never solves gives GRPO and SPO no signal).

    python -m spo_verl.tools.study.calibration [--tasks add_sub,add_sub_add,add_add,mul_add] [--problems 256] [--samples 4]

For each task of ``spo_verl.tools.cpu_settings.smollm2.TASKS``: held-out-style problems (the data's held-out seed),
the prompt the training data uses (worked examples as earlier chat turns), vLLM on the CPU with the
rollout's settings (float32, the task's ``data.max_response_length`` new tokens), scored by verl's GSM8K scorer as training scores them.
Prints greedy accuracy (what validation measures) and sampled accuracy at temperature 1 (what the
rollout sees) with standard errors over problems, pass@k, the share of problems whose k samples
disagree (where a group's advantages are not all zero), and the share of responses cut by the length
limit. The last line of stdout is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

def _standard_error(p: float, n: int) -> float:
    return (p * (1 - p) / n) ** 0.5 if n else float("nan")


def _mean_se(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5


def measure(tasks: list[str], count: int, samples: int, cache: Path) -> dict:
    from transformers import AutoTokenizer
    from verl.utils.reward_score.gsm8k import compute_score
    from vllm import LLM, SamplingParams

    from spo_verl.tools.cpu_settings import smollm2 as cpu_smollm2

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
            "sampled_accuracy": s, "sampled_se": _mean_se([sum(row) / samples for row in per_problem]),
            f"pass_at_{samples}": sum(any(row) for row in per_problem) / count,
            "mixed_groups": sum(0 < sum(row) < samples for row in per_problem) / count,
            "truncated": sum(cut) / len(cut),
            "mean_response_tokens": sum(len(c.token_ids) for o in sampled_out for c in o.outputs) / len(cut),
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
    from spo_verl.tools.cpu_settings.smollm2 import default_cache

    result = measure([t for t in args.tasks.split(",") if t], args.problems, args.samples, args.cache or default_cache())
    k = args.samples
    print(f"| task | example | greedy acc | sampled acc (T=1) | pass@{k} | problems with mixed samples | truncated |")
    print("|---|---|---|---|---|---|---|")
    for task, r in result["tasks"].items():
        print(f"| `{task}` | {r['example']} | {r['greedy_accuracy']:.3f} +- {r['greedy_se']:.3f} | "
              f"{r['sampled_accuracy']:.3f} +- {r['sampled_se']:.3f} | {r[f'pass_at_{k}']:.3f} | "
              f"{r['mixed_groups']:.3f} | {r['truncated']:.3f} |")
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
