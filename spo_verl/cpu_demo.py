"""SPO-tree end to end on a laptop CPU: a tiny Qwen2 built locally, a real vLLM engine on CPU, the
``spo_tree`` agent loop, verl's advantage step with the ``spo_tree`` estimator, and the
``spo_prob_mask`` loss through verl's actor loss, for a few on-policy iterations (new weights are
loaded into the running engine after each update). Prints a table per iteration and writes an HTML
view of the last iteration's segments.

    bash scripts/cpu_demo.sh [--steps 3] [--output-dir outputs/cpu_demo]

The model is random, so the reward is a toy rule ("the response contains a 7"): the point is to see
the machinery, not to learn arithmetic. verl's GPU services are stood in for by verl's own pieces
(``spo_verl.testing.verl_harness``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.utils.config import omega_conf_to_dataclass

import spo_verl.register  # noqa: F401
from spo_verl.agent_loops.tree_agent_loop import SPOTreeAgentLoop
from spo_verl.algorithms import probability_mask
from spo_verl.batch_context import provide_spo_rows
from spo_verl.policy_loss import spo_ppo_loss
from spo_verl.testing.tiny_vllm import CPUvLLMServer, build_tiny_qwen2, build_tiny_tokenizer
from spo_verl.testing.verl_harness import actor_batch, model_log_probs, run_sessions
from spo_verl.trainer.common import batch_metrics
from spo_verl.trainer.validation import validate_spo_run
from spo_verl.visualize import render_segments_html

RECIPE_CONFIG = Path(__file__).resolve().parents[1] / "recipe" / "spo" / "config"
PROMPTS = ["Add 3 and 4.", "What is 2*7?", "Count from 5 to 9.", "Is 17 prime?"]
TEMPERATURE = 1.0
RESPONSE_LENGTH = 48


def demo_config(model_dir: str, branching: list[int], segment_tokens: int):
    with initialize_config_dir(config_dir=str(RECIPE_CONFIG), version_base=None):
        config = compose(
            config_name="spo_trainer",
            overrides=[
                "spo_algorithm=spo_tree",
                f"actor_rollout_ref.model.path={model_dir}",
                f"algorithm.spo.tree.branching={branching}",
                f"algorithm.spo.tree.segment_tokens={segment_tokens}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
                "actor_rollout_ref.rollout.prompt_length=64",
                f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            ],
        )
    OmegaConf.resolve(config)
    validate_spo_run(config)
    return config


def reward(tokenizer, response_ids) -> float:
    return float("7" in tokenizer.decode(response_ids, skip_special_tokens=True))


async def one_iteration(step, config, server, tokenizer, actor, reference, optimizer, actor_config):
    sampling = {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    started = time.perf_counter()
    sessions = await asyncio.gather(*(
        run_sessions(SPOTreeAgentLoop, config, server, tokenizer, f"s{step}p{i}", [{"role": "user", "content": p}],
                     sampling_params=sampling)
        for i, p in enumerate(PROMPTS)
    ))
    rollout_seconds = time.perf_counter() - started
    leaves = [out for outputs in sessions for out in outputs if out != []]
    rows = [out.extra_fields["spo"] for out in leaves]
    rewards = [reward(tokenizer, out.response_ids) for out in leaves]

    width = max(len(out.response_ids) for out in leaves)
    response_mask = torch.zeros(len(leaves), width)
    token_rewards = torch.zeros(len(leaves), width)
    for b, (out, r) in enumerate(zip(leaves, rewards)):
        response_mask[b, : len(out.response_ids)] = 1
        token_rewards[b, len(out.response_ids) - 1] = r
    data = DataProto.from_dict(
        tensors={"token_level_rewards": token_rewards, "response_mask": response_mask},
        non_tensors={"uid": np.array([row["tree_id"] for row in rows], dtype=object)},
    )
    with provide_spo_rows(rows) as context:
        advantages = compute_advantage(data, "spo_tree", config=config.algorithm).batch["advantages"]
    metrics = batch_metrics(context, response_mask)
    trained_mask = context.trained_mask.float() * response_mask

    prompts = [out.prompt_ids for out in leaves]
    responses = [out.response_ids for out in leaves]
    # On-policy: before the update the actor is the sampling policy, so one forward gives both the
    # graph for the loss and (detached) the old log-probs.
    nested_log_probs, old_log_probs = model_log_probs(actor, prompts, responses, TEMPERATURE)
    with torch.no_grad():
        _, ref_log_probs = model_log_probs(reference, prompts, responses, TEMPERATURE)
    batch = actor_batch(prompts, responses, tokenizer.pad_token_id, width, response_mask=trained_mask,
                        old_log_probs=old_log_probs, ref_log_prob=ref_log_probs, advantages=advantages)
    loss, _ = spo_ppo_loss(actor_config, {"log_probs": nested_log_probs}, batch)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0))
    optimizer.step()

    prob_mask = probability_mask(old_log_probs, response_mask, config.algorithm.spo.prob_mask.threshold)
    rollout_log_probs = torch.zeros_like(old_log_probs)
    for b, out in enumerate(leaves):
        rollout_log_probs[b, : len(out.response_logprobs)] = torch.tensor(out.response_logprobs)
    # The engine samples with the weights the actor has (on-policy): its log-probs match the actor's.
    log_prob_gap = float(((rollout_log_probs - old_log_probs).abs() * response_mask).max())
    summary = {
        "mean reward": float(np.mean(rewards)),
        "leaves": float(len(leaves)),
        "rollout seconds": rollout_seconds,
        "loss": loss.item(),
        "grad norm": grad_norm,
        "max |rollout - actor log-prob|": log_prob_gap,
        **{k.removeprefix("spo/"): v for k, v in metrics.items()},
        "prob_mask/masked_fraction": float(prob_mask.sum() / response_mask.sum()),
    }
    view = dict(rows=rows, responses=responses, rewards=rewards, advantages=advantages, prob_mask=prob_mask,
                trained_mask=trained_mask.bool())
    return summary, view


async def run(args) -> Path:
    output_dir = Path(args.output_dir)
    model_dir = output_dir / "model"
    tokenizer = build_tiny_tokenizer(model_dir)
    build_tiny_qwen2(model_dir, tokenizer, seed=args.seed)
    config = demo_config(str(model_dir), args.branching, args.segment_tokens)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(actor).eval()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=args.lr)
    server = await CPUvLLMServer.start(model_dir, seed=args.seed, prompt_length=64, response_length=RESPONSE_LENGTH)
    try:
        print(f"SPO-tree CPU demo: branching {args.branching}, segment budget {args.segment_tokens}, "
              f"{len(PROMPTS)} prompts, temperature {TEMPERATURE}")
        for step in range(args.steps):
            summary, view = await one_iteration(step, config, server, tokenizer, actor, reference, optimizer, actor_config)
            print(f"\niteration {step}")
            for key, value in summary.items():
                print(f"  {key:<48} {value:>10.4g}")
            actor.save_pretrained(model_dir)  # on-policy: the engine samples the next iteration from the update
            await server.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
    finally:
        await server.shutdown()
    page = output_dir / "segments.html"
    page.write_text(render_segments_html(
        "SPO-tree segments (last iteration)", decode_token=lambda t: tokenizer.decode([t]), summary=summary, **view))
    print(f"\nsegment view: {page}")
    return page


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="on-policy iterations (default 3)")
    parser.add_argument("--branching", type=lambda s: [int(x) for x in s.split(",")], default=[3, 3],
                        help="tree shape, e.g. 3,3 (default)")
    parser.add_argument("--segment-tokens", type=int, default=16, help="token budget of every depth but the last")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/cpu_demo")
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
