"""verl's actor training worker (``TrainingWorker`` with the FSDP2 engine) built in this process on
the ``spo_cpu`` platform, and SPO-tree training batches in verl's layout, for the packed-training
tests and benchmarks.

Call :func:`start_process_group` before importing verl: it sets the single-process torch.distributed
world (gloo) and the platform variables the engine needs on CPU.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence

import torch

__all__ = ["start_process_group", "build_actor_worker", "rows_training_batch", "tree_training_batch",
           "parameter_gradients"]

PADDING_PROMPT_TOKENS = 3


def start_process_group() -> None:
    os.environ.update(VERL_PLATFORM="spo_cpu", VERL_ENGINE_DEVICE="cuda", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


def build_actor_worker(model_dir: str, *, micro_batch_size: int, gradient_checkpointing: bool = True,
                       use_dynamic_bsz: bool = False, max_token_len: int = 4096, policy_loss: str = "vanilla",
                       mixed_precision: str = "fp32"):
    """verl's actor ``TrainingWorker`` (FSDP2 engine, fp32 weights, padded attention as on CPU) and
    verl's ``ppo_loss`` for it, configured from verl's own ``ppo_trainer`` defaults.
    ``mixed_precision``: ``fp32`` computes in float32; ``verl`` keeps verl's default FSDP mixed
    precision (bfloat16 parameters in the forward and backward, float32 gradient reduction), as on a GPU."""
    if mixed_precision not in ("fp32", "verl"):
        raise ValueError(f"mixed_precision must be 'fp32' or 'verl', got {mixed_precision!r}")
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from spo_workbench.testing.verl_harness import compose_ppo_trainer

    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    config = compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        *([f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}"] if mixed_precision == "fp32" else []),
        "actor_rollout_ref.model.use_remove_padding=false",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(gradient_checkpointing).lower()}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.actor.use_dynamic_bsz={str(use_dynamic_bsz).lower()}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch_size}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_token_len}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={policy_loss}",
        "actor_rollout_ref.rollout.n=1",
    )
    model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    worker_config = TrainingWorkerConfig(
        model_type="language_model", model_config=model_config, engine_config=actor_config.engine,
        optimizer_config=actor_config.optim, checkpoint_config=actor_config.checkpoint,
    )
    engine_config = worker_config.engine_config
    engine_config.use_dynamic_bsz = use_dynamic_bsz
    engine_config.micro_batch_size_per_gpu = engine_config.infer_micro_batch_size_per_gpu = micro_batch_size
    engine_config.max_token_len_per_gpu = engine_config.infer_max_token_len_per_gpu = max_token_len
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    return worker, partial(ppo_loss, config=actor_config)


def tree_training_batch(trees: Sequence, *, pad_token_id: int, response_length: int, rng: random.Random,
                        plain_rows: int = 0, padding_rows: int = 0, vocab: int = 61, temperature: float = 1.0,
                        micro_batch_size: int | None = None, use_dynamic_bsz: bool = False,
                        max_token_len: int = 4096, calculate_entropy: bool = False, groups: int = 0,
                        group_size: int = 4):
    """An actor batch in verl's no-padding layout: every leaf row of ``trees``
    (:class:`spo_workbench.testing.random_trees.Tree`) with its ``spo`` metadata and uid; then ``groups``
    prompt groups as GRPO, PPO and SPO-chain batches hold them (``group_size`` responses of one prompt
    under one uid, prompts opening with a preamble common to all groups, responses sharing their
    first tokens, one early EOS per group); ``plain_rows`` rows of their own; ``padding_rows`` rows as
    verl's batch padding makes them (EOS tokens, uid ``pad...``, the first row's metadata copied,
    nothing trained). Old log-probs and advantages are random; the response mask trains every token."""
    prompts, responses, metadata, uids = [], [], [], []
    for index, tree in enumerate(trees):
        for path, ends, response in zip(tree.paths, tree.ends, tree.responses):
            prompts.append(tree.prompt)
            responses.append(response)
            metadata.append({"tree_id": f"tree{index}", "path": list(path), "segment_ends": list(ends)})
            uids.append(f"uid{index}")
    preamble = [rng.randrange(vocab) for _ in range(5)]
    for group in range(groups):
        prompt = preamble + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        opening = [rng.randrange(vocab) for _ in range(2)]
        for member in range(group_size):
            length = 1 if member == 1 else rng.randint(3, response_length)  # member 1: an early EOS
            prompts.append(prompt)
            responses.append((opening + [rng.randrange(vocab) for _ in range(length)])[:length])
            metadata.append({"kind": "group"})
            uids.append(f"group{group}")
    for row in range(plain_rows):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(2, 6))])
        responses.append([rng.randrange(vocab) for _ in range(rng.randint(1, response_length))])
        metadata.append(None)
        uids.append(f"plain{row}")
    for _ in range(padding_rows):  # one template and one uid, as verl's upsample_batch_to_divisible_size
        prompts.append([pad_token_id] * PADDING_PROMPT_TOKENS)
        responses.append([pad_token_id])
        metadata.append(dict(metadata[0]) if metadata else None)
        uids.append("pad5e1f")
    return rows_training_batch(prompts, responses, uids, metadata, pad_token_id=pad_token_id,
                               response_length=response_length, rng=rng, temperature=temperature,
                               micro_batch_size=micro_batch_size, use_dynamic_bsz=use_dynamic_bsz,
                               max_token_len=max_token_len, calculate_entropy=calculate_entropy)


def rows_training_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], uids: Sequence[str],
                        metadata: Sequence | None = None, *, pad_token_id: int, response_length: int,
                        rng: random.Random, temperature: float = 1.0, micro_batch_size: int | None = None,
                        use_dynamic_bsz: bool = False, max_token_len: int = 4096, calculate_entropy: bool = False):
    """An actor batch in verl's no-padding layout from given rows (prompt and response token ids, uid,
    ``spo`` metadata or None). Old log-probs and advantages are random; the response mask trains every
    token except those of rows whose uid marks verl's padding."""
    from tensordict import NonTensorStack
    from verl.utils import tensordict_utils as tu

    from spo_verl.adapters.advantage_channel import is_padding_uid
    from spo_workbench.testing.verl_harness import actor_batch

    batch = len(prompts)
    metadata = list(metadata) if metadata is not None else [None] * batch
    mask = torch.zeros(batch, response_length)
    for row, response in enumerate(responses):
        mask[row, : len(response)] = 0.0 if is_padding_uid(uids[row]) else 1.0
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    data = actor_batch(
        prompts, responses, pad_token_id, response_length,
        response_mask=mask,
        old_log_probs=-torch.rand(batch, response_length, generator=generator) * 4,
        advantages=torch.randn(batch, response_length, generator=generator) * mask,
    )
    data["spo"] = NonTensorStack(*metadata, batch_size=[batch])
    data["uid"] = NonTensorStack(*uids, batch_size=[batch])
    tu.assign_non_tensor(
        data, temperature=temperature, use_remove_padding=False, use_dynamic_bsz=use_dynamic_bsz,
        micro_batch_size_per_gpu=micro_batch_size or batch, max_token_len_per_gpu=max_token_len,
        calculate_entropy=calculate_entropy, use_fused_kernels=False,
    )
    return data


def parameter_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradient of every parameter, by name."""
    gradients = {}
    for name, parameter in module.named_parameters():
        if parameter.grad is None:
            continue
        grad = parameter.grad
        gradients[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return gradients
