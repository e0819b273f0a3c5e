"""An SPO run's configuration, checked before Ray or any GPU is touched: the SPO settings against verl's
rollout and trainer settings, the micro-batches, the nodes, and the names verl will look up.

The agent loop, advantage estimator, policy loss and reward function a run names are looked up here,
as verl 0.9.1 would look them up once Ray runs. verl internals this relies on:
``verl.experimental.agent_loop.agent_loop._agent_loop_registry`` (private; verl's agent-loop workers
also add the entries of ``actor_rollout_ref.rollout.agent.agent_loop_config_path``, read here with
``verl.utils.import_utils.resolve_config_path``), ``verl.trainer.ppo.core_algos.ADV_ESTIMATOR_REGISTRY``
and ``POLICY_LOSS_REGISTRY``, ``verl.utils.import_utils.import_external_libs`` and its
``PKG_PATH_PREFIX``/``FILE_PATH_PREFIX`` (how ``verl.trainer.ppo.reward.get_custom_reward_fn`` reads
``reward.custom_reward_function.path``), and ``ray_trainer.compute_advantage`` computing ``gae`` and
``grpo`` without the registry.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.experimental.agent_loop.tool_parser import ToolParser
from verl.tools.tool_registry import load_all_tools
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, AdvantageEstimator
from verl.utils.import_utils import FILE_PATH_PREFIX, PKG_PATH_PREFIX, import_external_libs, resolve_config_path

import spo_verl.register  # noqa: F401  (the plugin's names registered before they are looked up)
from spo_verl.adapters.agent_loops.episode_agent_loop import plays_episodes
from spo_verl.adapters.agent_loops.tool_environment import VERL_TOOLS
from spo_verl.adapters.policy_loss import LOSS_NAME
from spo_verl.adapters.trainer.v1 import TRAINER_MODE
from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.settings import spo_settings
from spo_verl.core.episodes.environment import environment_factory
from spo_verl.core.rollout.tree_shape import check_cutpoint_tree_fits, check_tree_fits, tree_segment_budgets

logger = logging.getLogger(__name__)

#: vLLM's KV-cache block size when ``engine_kwargs.vllm.block_size`` is not set: 16 on GPUs, 128 on
#: its CPU backend.
VLLM_DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}


def validate_spo_run(config: Any) -> None:
    """Raise ``ValueError`` naming the setting to change if the configuration cannot run SPO."""
    check_registered_names(config)
    settings = spo_settings(config.algorithm)
    estimator = config.algorithm.adv_estimator
    rollout = config.actor_rollout_ref.rollout
    agent_loop = rollout.agent.default_agent_loop
    if estimator in SPO_ALGORITHMS:
        if agent_loop != estimator:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs actor_rollout_ref.rollout.agent.default_agent_loop="
                f"{estimator} (got {agent_loop}): only that agent loop produces the segment metadata"
            )
        if config.trainer.get("use_v1", True) and config.trainer.v1.trainer_mode != TRAINER_MODE:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs trainer.v1.trainer_mode={TRAINER_MODE} (got "
                f"{config.trainer.v1.trainer_mode}): that trainer hands the segment metadata to the estimator"
            )
    if agent_loop in SPO_ALGORITHMS and not config.trainer.get("use_v1", True):
        # verl's legacy agent-loop manager splits the repeated batch into num_workers equal chunks; a
        # prompt's sessions (one tree, or one shared Monte Carlo cache) must land in one chunk.
        prompts = config.data.get("gen_batch_size", None) or config.data.train_batch_size
        workers = rollout.agent.num_workers
        if prompts % workers:
            raise ValueError(
                f"actor_rollout_ref.rollout.agent.default_agent_loop={agent_loop} on the legacy trainer needs "
                f"data.train_batch_size ({prompts}) to be a multiple of actor_rollout_ref.rollout.agent.num_workers "
                f"({workers}): verl splits each batch into that many equal chunks and a prompt's sessions must stay in one"
            )
    if estimator == "spo_tree" and settings.tree.branch_at == "cutpoint":
        check_cutpoint_tree_fits(settings.tree.cutpoint, rollout.n)
    elif estimator == "spo_tree" and settings.tree.branch_at == "turn":  # a turn is as long as it is: no budgets
        check_tree_fits(settings.tree.branching, (), rollout.response_length, rollout.n)
    elif estimator == "spo_tree":
        check_tree_fits(settings.tree.branching, tree_segment_budgets(settings.tree), rollout.response_length, rollout.n,
                        settings.tree.align_to_block)
        warn_if_segments_split_blocks(settings.tree, rollout, config.trainer.get("device", "cuda"))

    check_context_fits(rollout)
    check_log_prob_micro_batches(config.actor_rollout_ref)
    if plays_episodes(config):
        check_episodes(settings.turns, rollout, config.actor_rollout_ref.model.path)
    elif settings.turns.environment is not None:
        raise ValueError(
            f"algorithm.spo.turns.environment={settings.turns.environment} would be ignored: only multi-turn episodes "
            f"use it (algorithm.spo.chain.partition=turn with spo_chain, algorithm.spo.tree.branch_at=turn with "
            f"spo_tree, or actor_rollout_ref.rollout.agent.default_agent_loop=spo_episode), and this run "
            f"(algorithm.adv_estimator={estimator}, default_agent_loop={agent_loop}) samples single-turn responses; "
            f"choose one of those or drop the setting"
        )

    if settings.packing.enable:
        check_packed_training(config)
    check_rollout_log_probs_as_old(config)


def check_log_prob_micro_batches(actor_rollout_ref: Any) -> None:
    """verl's engine worker asserts, once Ray has started it, that the old-log-prob pass micro-batches as
    the actor update does (``verl.workers.engine_workers.ActorRolloutRefWorker.init_model``)."""
    update, log_probs = actor_rollout_ref.actor.use_dynamic_bsz, actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    if bool(update) != bool(log_probs):
        raise ValueError(
            f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={log_probs} differs from "
            f"actor_rollout_ref.actor.use_dynamic_bsz={update}: verl's actor worker computes the old log-probs with the "
            f"update's micro-batching and refuses the difference when it starts; set both alike"
        )


def check_context_fits(rollout: Any) -> None:
    """A ``max_model_len`` set below prompt + response: verl's server would silently shorten the
    responses (a tree's segments, an episode's late turns) that reach past it, and refuse a request (a
    turn after the environment's reply) that leaves it no room at all."""
    context = rollout.get("max_model_len", None)
    if context is not None and context < rollout.prompt_length + rollout.response_length:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_model_len={context} is less than the prompt and response it must hold: "
            f"data.max_prompt_length ({rollout.prompt_length}) + data.max_response_length ({rollout.response_length}) "
            f"= {rollout.prompt_length + rollout.response_length}; raise it or leave it unset (verl then uses the "
            f"model's max_position_embeddings)"
        )


def check_episodes(turns: Any, rollout: Any, model_path: str) -> None:
    """Multi-turn episodes: the environment can be made, a turn leaves room for a reply, and the model's
    chat template renders a reply after a turn (where its tokenizer can be loaded here)."""
    if turns.environment is None:
        raise ValueError("multi-turn episodes (algorithm.spo.chain.partition=turn, or actor_rollout_ref.rollout.agent."
                         "default_agent_loop=spo_episode) need algorithm.spo.turns.environment: a registered environment "
                         f"(e.g. arithmetic_dialogue), {VERL_TOOLS} or module:attribute")
    if turns.environment == VERL_TOOLS:
        check_tools(rollout.multi_turn)
    else:
        environment_factory(turns.environment)
    response_length = rollout.response_length
    if turns.max_turn_tokens is not None and turns.max_turn_tokens >= response_length:
        raise ValueError(
            f"algorithm.spo.turns.max_turn_tokens={turns.max_turn_tokens} leaves no room in "
            f"actor_rollout_ref.rollout.response_length={response_length} for the environment's reply and a second "
            f"turn: lower it or raise the response length"
        )
    from verl.utils import hf_tokenizer

    from spo_verl.adapters.agent_loops.episode_agent_loop import chat_reply_tokens

    try:
        tokenizer = hf_tokenizer(model_path)
    except OSError:  # a hub model on a machine without its files: the first episode checks it
        return
    chat_reply_tokens(tokenizer, "")


def check_tools(multi_turn: Any) -> None:
    """``verl_tools``: the tools load as verl's worker loads them, and verl has a parser for their format."""
    paths = {key: multi_turn.get(key, None) for key in ("tool_config_path", "function_tool_path")}
    if not any(paths.values()):
        raise ValueError(f"algorithm.spo.turns.environment={VERL_TOOLS} needs tools: set "
                         f"actor_rollout_ref.rollout.multi_turn.tool_config_path or function_tool_path")
    if multi_turn.format not in ToolParser._registry:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={multi_turn.format} is not one of verl's tool "
                         f"parsers: {sorted(ToolParser._registry)}")
    try:
        load_all_tools(**{key: resolve_config_path(path) if path else None for key, path in paths.items()})
    except Exception as error:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn tools cannot be loaded ({paths}): "
                         f"{type(error).__name__}: {error}") from error


def check_registered_names(config: Any) -> None:
    """Raise ``ValueError`` naming the setting and the registered names if verl would not find the
    agent loop, advantage estimator, policy loss or reward function the configuration names."""
    # verl's model config imports external_lib before any worker looks a name up; a plugin there may
    # register names of its own.
    external_lib = config.actor_rollout_ref.model.get("external_lib", None) or None
    try:
        import_external_libs(external_lib)
    except ImportError as error:
        raise ValueError(f"actor_rollout_ref.model.external_lib={external_lib} cannot be imported: {error}") from error
    agent = config.actor_rollout_ref.rollout.agent
    agent_loops = {*_agent_loop_registry, *agent_loops_in_file(agent)}
    if agent.default_agent_loop not in agent_loops:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={agent.default_agent_loop} is not a registered "
            f"agent loop; registered: {sorted(agent_loops)}"
        )
    estimator = config.algorithm.adv_estimator
    estimator = estimator.value if isinstance(estimator, Enum) else estimator
    # verl's compute_advantage computes gae and grpo itself; every other name goes through the registry.
    estimators = {*ADV_ESTIMATOR_REGISTRY, AdvantageEstimator.GAE.value, AdvantageEstimator.GRPO.value}
    if estimator not in estimators:
        raise ValueError(f"algorithm.adv_estimator={estimator} is not a registered advantage estimator; "
                         f"registered: {sorted(estimators)}")
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} is not a registered policy "
                         f"loss; registered: {sorted(POLICY_LOSS_REGISTRY)}")
    check_reward_function(config.get("reward", None) or {})


def agent_loops_in_file(agent: Any) -> list[str]:
    """The agent loops verl's agent-loop workers register from ``agent_loop_config_path``."""
    path = agent.get("agent_loop_config_path", None)
    if not path:
        return []
    try:
        entries = OmegaConf.load(resolve_config_path(path))
    except FileNotFoundError:
        raise ValueError(f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}: no such file") from None
    return [str(entry.name) for entry in entries]


def check_reward_function(reward: Any) -> None:
    """``reward.custom_reward_function`` as verl's ``get_custom_reward_fn`` reads it: a file (``file://``
    optional) or a module (``pkg://``) that defines ``name`` at its top level. The source is read, not
    run: the file's own imports may be heavy, and a driver need not run them to find a name."""
    selection = reward.get("custom_reward_function", None) or {}
    path, name = selection.get("path", None), selection.get("name", None)
    if not path:
        return
    key = "reward.custom_reward_function"
    if not name:
        raise ValueError(f"{key}.path={path} needs {key}.name, the function to call")
    source = reward_source_file(path)
    if source is None or source.suffix != ".py":
        return  # a compiled or namespace module: nothing to read
    module = ast.parse(source.read_text(), filename=str(source))
    defined = top_level_names(module)
    if name in defined or "*" in defined or "__getattr__" in defined:  # the last two make names at import
        return
    functions = sorted(node.name for node in module.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
    raise ValueError(f"{key}.name={name} is not defined in {key}.path={path}; its functions: {functions}")


def reward_source_file(path: str) -> Path | None:
    key = "reward.custom_reward_function.path"
    if path.startswith(PKG_PATH_PREFIX):
        module = path[len(PKG_PATH_PREFIX):].replace("/", ".")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a parent package is missing, or the name is empty
            spec = None
        if spec is None:
            raise ValueError(f"{key}={path}: no module named {module}")
        return Path(spec.origin) if spec.origin and spec.has_location else None
    file = Path(path.removeprefix(FILE_PATH_PREFIX))
    if not file.is_file():
        raise ValueError(f"{key}={path}: no such file" + ("" if file.is_absolute() else f" in {Path.cwd()}"))
    return file


def top_level_names(module: ast.Module) -> set[str]:
    """Names a module binds in its own namespace (``*`` for a star import)."""
    names, nodes = set(), list(module.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            nodes.extend(ast.iter_child_nodes(node))  # own scopes are skipped: their names are not the module's
    return names


def engine_block_size(rollout: Any, device: str) -> int | None:
    """The vLLM rollout's KV-cache block size; None for other engines."""
    if rollout.get("name", "vllm") != "vllm":
        return None
    engine = (rollout.get("engine_kwargs", None) or {}).get("vllm", None) or {}
    return int(engine.get("block_size", None) or VLLM_DEFAULT_BLOCK_SIZE.get(device, VLLM_DEFAULT_BLOCK_SIZE["cuda"]))


def warn_if_segments_split_blocks(tree: Any, rollout: Any, device: str) -> None:
    """A child's request recomputes the part of its prefix past the last whole cached block: up to a
    block per child, as many tokens as a short segment generates. Said once, at config time."""
    block = engine_block_size(rollout, device)
    if block is None:
        return
    if tree.align_to_block and tree.align_to_block != block:
        logger.warning("algorithm.spo.tree.align_to_block=%s differs from the rollout engine's KV-cache block size %s "
                       "(actor_rollout_ref.rollout.engine_kwargs.vllm.block_size): children will recompute up to a block "
                       "of their prefix", tree.align_to_block, block)
    budgets = list(tree_segment_budgets(tree))
    if not tree.align_to_block and any(budget < block for budget in budgets):
        logger.warning("algorithm.spo.tree.segment_tokens %s has segments shorter than the rollout engine's KV-cache "
                       "block (%s tokens): each child recomputes up to a block of its prefix, about as many tokens as its "
                       "segment generates. Longer segments or algorithm.spo.tree.align_to_block=%s cut that to one token",
                       budgets, block, block)


def check_rollout_log_probs_as_old(config: Any) -> None:
    """verl's ``algorithm.rollout_correction.bypass_mode`` takes the rollout's log-probs as the old
    log-probs. The v1 trainer only skips the old-log-prob pass; the legacy trainer also replaces the
    policy loss with its own ``bypass_mode`` loss, which would drop SPO's probability mask unseen."""
    correction = config.algorithm.get("rollout_correction", None) or {}
    if not correction.get("bypass_mode", False):
        return
    if not config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probs as the old "
                         "log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true")
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    if not config.trainer.get("use_v1", True) and loss_mode == LOSS_NAME:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true on the legacy trainer (trainer.use_v1=false) replaces "
            f"actor_rollout_ref.actor.policy_loss.loss_mode={LOSS_NAME} with verl's bypass_mode loss, which has no "
            f"probability mask: set algorithm.rollout_correction.bypass_mode=false or trainer.use_v1=true"
        )


def check_packed_training(config: Any) -> None:
    """``algorithm.spo.packing.enable=true`` runs only where the packed forward equals verl's."""
    key = "algorithm.spo.packing.enable=true"
    actor_ref = config.actor_rollout_ref
    for role in ("actor", "ref"):
        section = actor_ref.get(role, {})
        strategy = section.get("strategy", "fsdp")
        if strategy not in ("fsdp", "fsdp2"):
            raise ValueError(f"{key} needs verl's FSDP engine: actor_rollout_ref.{role}.strategy must be fsdp or "
                             f"fsdp2 (got {strategy})")
        for name in ("ulysses_sequence_parallel_size",):
            size = max(int(section.get(name, 1) or 1), int(section.get("fsdp_config", {}).get(name, 1) or 1))
            if size > 1:
                raise ValueError(f"{key} does not support sequence parallelism: actor_rollout_ref.{role}.{name} "
                                 f"must be 1 (got {size})")
    model = actor_ref.model
    unsupported = {  # each must be off (false, 0 or null)
        "actor_rollout_ref.model.use_fused_kernels": model.get("use_fused_kernels", False),
        "actor_rollout_ref.actor.use_fused_kernels": actor_ref.actor.get("use_fused_kernels", False),
        "actor_rollout_ref.actor.pad_to_length": actor_ref.actor.get("pad_to_length", None),
        "actor_rollout_ref.actor.calculate_sum_pi_squared": actor_ref.actor.get("calculate_sum_pi_squared", False),
        "actor_rollout_ref.model.lora_rank": model.get("lora_rank", 0),
        "actor_rollout_ref.model.lora.rank": model.get("lora", {}).get("rank", 0),
        "actor_rollout_ref.model.lora_adapter_path": model.get("lora_adapter_path", None),
        "distillation.enabled": config.get("distillation", {}).get("enabled", False),
    }
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"{key} does not support {name}={value}; turn it off or set packing.enable=false")


# verl's actor worker asserts this after Ray and the models are up.
MOST_GPUS_LISTED = 64


def check_micro_batches(config: Any) -> None:
    """With micro-batches of a set number of rows (``use_dynamic_bsz=false``), an optimizer step's rows
    (``ppo_mini_batch_size`` x ``rollout.n``) must split evenly over the GPUs (verl's actor worker asserts
    it, after Ray and the models are up) and then into whole micro-batches: the reference loss whitens over
    each micro-batch (docs/FIDELITY.md, item 6), so a short last one would be a group of another size."""
    actor = config.actor_rollout_ref.actor
    micro = actor.get("ppo_micro_batch_size_per_gpu", None)
    if actor.use_dynamic_bsz or not micro:
        return
    rows = actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    trainer = config.trainer
    gpus = trainer.n_gpus_per_node * trainer.nnodes
    if rows % gpus == 0 and (rows // gpus) % micro == 0:
        return
    allowed = [count for count in range(1, MOST_GPUS_LISTED + 1) if rows % count == 0 and (rows // count) % micro == 0]
    raise ValueError(
        f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} x actor_rollout_ref.rollout.n="
        f"{config.actor_rollout_ref.rollout.n} = {rows} rows an optimizer step over trainer.n_gpus_per_node="
        f"{trainer.n_gpus_per_node} (GPUS_PER_NODE) x trainer.nnodes={trainer.nnodes} (NNODES) = {gpus} GPUs is not a "
        f"whole number of micro-batches of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} rows on each: "
        f"GPU counts that are: {', '.join(map(str, allowed)) or 'none'}")


def check_nodes_join_a_cluster(config: Any) -> None:
    """Several nodes train only in a Ray cluster started on them, which the launch joins: without an address
    it would start a Ray of its own on this node and wait for the other nodes' GPUs for ever."""
    nodes = config.trainer.nnodes
    ray_init = (config.get("ray_kwargs") or {}).get("ray_init") or {}
    if nodes > 1 and not (ray_init.get("address") or os.environ.get("RAY_ADDRESS")):
        raise ValueError(
            f"trainer.nnodes={nodes} (NNODES) needs a running Ray cluster of {nodes} nodes to join, and this launch "
            "names none: start Ray on every node (ray start --head on this one, ray start --address=<head>:6379 on the "
            "others) and launch with +ray_kwargs.ray_init.address=auto (or RAY_ADDRESS=<head>:6379); on one node, "
            "NNODES=1 (docs/CLUSTER.md, \"Several nodes\")")
