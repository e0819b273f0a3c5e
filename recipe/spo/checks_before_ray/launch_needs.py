"""What a launch needs that verl would only find once Ray, the tokenizer or the workers are up: the model,
the data, the attention kernel and a GPU. Checked in the driver, in seconds, by every launch and by
``--check`` (which reports the GPU instead of requiring it and then stops).

A problem raises ``ValueError`` naming the setting and what to do (the entry point prints it as one
line); what cannot be checked from here (a hub model not cached, an ``hdfs://`` path) is reported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import recipe.spo.checks_before_ray.gpu_environment as gpu_environment

# verl's own pin (its ``fsdp`` extra); it builds against the torch already installed.
FLASH_ATTN_INSTALL = "pip install flash-attn==2.8.3 --no-build-isolation"
# verl's default attention (``HFModelConfig``): the one kernel that keeps rows apart without padding.
VERLS_ATTENTION = "flash_attention_2"


def check_launch(config: Any, torch_module=None) -> list[str]:
    """Raise ``ValueError`` for what would stop the run after it started; return what a user should know."""
    return [*check_gpu_count(config, torch_module), *check_cluster(config), *check_models(config),
            *check_data_files(config), *check_attention(config, torch_module)]


def ray_address(config: Any) -> str | None:
    """The running Ray cluster the launch joins (``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS``), or None."""
    ray_init = (config.get("ray_kwargs") or {}).get("ray_init") or {}
    return ray_init.get("address") or os.environ.get("RAY_ADDRESS") or None


def cluster_gcs(address: str, timeout: float = 3.0) -> str | None:
    """The cluster's ``host:port`` if something listens there (``auto``: the cluster this node's ``ray start``
    recorded), else None: Ray's own connect waits minutes for an address nothing answers at."""
    import socket

    from ray._private.utils import read_ray_address

    if address == "auto":
        address = read_ray_address()
    if not address or "://" in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return None
    return address


def check_cluster(config: Any) -> list[str]:
    """With a cluster to join: its alive nodes and their GPUs against ``trainer.nnodes`` x
    ``trainer.n_gpus_per_node``, where this process reaches it (verl would ask Ray for the GPUs and wait for
    ever). Connects as a Ray client for the look and disconnects, before the run's own connection."""
    address = ray_address(config)
    if address is None:
        return []
    gcs = cluster_gcs(address)
    if gcs is None:
        return [f"Ray cluster at {address}: none answers from here (a Ray client address, no cluster on this node, or "
                f"its port closed), so its nodes are not checked"]
    import ray

    try:
        ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
        nodes = [node for node in ray.nodes() if node.get("Alive")]
    except (ConnectionError, RuntimeError, ValueError) as error:
        return [f"Ray cluster at {address}: not reached from here ({type(error).__name__}), so its nodes are not checked"]
    finally:
        ray.shutdown()
    trainer = config.trainer
    per_node = sorted((int(node["Resources"].get("GPU", 0)) for node in nodes), reverse=True)
    enough = sum(1 for gpus in per_node if gpus >= trainer.n_gpus_per_node)
    if enough < trainer.nnodes:
        raise ValueError(
            f"trainer.nnodes={trainer.nnodes} (NNODES) x trainer.n_gpus_per_node={trainer.n_gpus_per_node} (GPUS_PER_NODE): "
            f"the Ray cluster at {address} has {len(nodes)} alive node(s) with {per_node} GPUs, {enough} of them with "
            f"{trainer.n_gpus_per_node} or more; start Ray on every node the run needs (docs/CLUSTER.md, \"Several "
            f"nodes\"), or set NNODES and GPUS_PER_NODE to the cluster's")
    return [f"Ray cluster at {address}: {len(nodes)} alive node(s), GPUs per node {per_node}: enough for "
            f"{trainer.nnodes} x {trainer.n_gpus_per_node}"]


def check_gpu_count(config: Any, torch_module=None) -> list[str]:
    """``trainer.n_gpus_per_node`` against the GPUs this node sees, where it sees any (``--check`` on a login
    node sees none: not checked there). verl asks Ray for that many GPUs a node and would wait for them."""
    if not needs_gpu(config):
        return []
    if torch_module is None:
        import torch as torch_module
    if torch_module.version.cuda is None:
        return []
    visible = torch_module.cuda.device_count()
    wanted = config.trainer.n_gpus_per_node
    if visible == 0:
        return ["GPUs per node: not checked (this node sees no GPU)"]
    if wanted > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"trainer.n_gpus_per_node={wanted} (GPUS_PER_NODE) but this node sees {visible} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={shown if shown is not None else 'unset'}): set GPUS_PER_NODE to at "
                         f"most {visible}, or launch on a node with {wanted}")
    return [f"GPUs per node: trainer.n_gpus_per_node={wanted}, this node sees {visible}"]


def needs_gpu(config: Any) -> bool:
    return config.trainer.get("device", "cuda") != "cpu"


def gpu_problem(config: Any, setting: str, torch_module=None) -> str | None:
    """Why this Python cannot train the configuration on GPUs, or None (CPU settings need none)."""
    if not needs_gpu(config):
        return None
    return gpu_environment.problem(setting, torch_module)


# --- model and tokenizer ------------------------------------------------------------------------------


def model_paths(config: Any) -> dict[str, str]:
    """Each model or tokenizer path a run loads, by the key that sets it (the critic's only when PPO has one)."""
    from verl.trainer.ppo.utils import need_critic

    model = config.actor_rollout_ref.model
    paths = {"actor_rollout_ref.model.path": model.path}
    if model.get("tokenizer_path", None):
        paths["actor_rollout_ref.model.tokenizer_path"] = model.tokenizer_path
    if need_critic(config):
        paths["critic.model.path"] = config.critic.model.path
        if config.critic.model.get("tokenizer_path", None):
            paths["critic.model.tokenizer_path"] = config.critic.model.tokenizer_path
    return paths


def check_models(config: Any) -> list[str]:
    """Each distinct path once, under the first key that names it."""
    first_key: dict[str, str] = {}
    for key, path in model_paths(config).items():
        first_key.setdefault(path, key)
    template = config.actor_rollout_ref.model.get("custom_chat_template", None)
    return [check_model(key, str(path), template) for path, key in first_key.items()]


def looks_local(path: str) -> bool:
    """A folder path rather than a hub id ("org/name"): verl passes a hub id to transformers, which downloads it."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") != 1 or Path(path).exists()


def check_model(key: str, path: str, chat_template: str | None) -> str:
    if "://" in path:
        return f"{key}={path}: a remote path, not checked here (verl copies it to each node)"
    if is_hub_id(path):
        return check_hub_model(key, path, chat_template)
    # A path whose first folder is here ("models/sft" beside a models/ folder) is a local path, even with one
    # slash: taken for a hub id, it would be looked up on the hub and fail there, or download another model.
    folder = Path(path).expanduser()
    if not folder.is_dir():
        where = "" if folder.is_absolute() else f" (read from the working directory: {Path.cwd() / folder})"
        raise ValueError(f"{key}={path}: no such model folder{where} (set MODEL_PATH, or the setting's model, to a folder "
                         f"with config.json and the tokenizer, or to a hub id org/name)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}={path}: the folder has no config.json, so it is not a Hugging Face model")
    check_tokenizer(key, str(folder), chat_template)
    return f"{key}={path}: model and tokenizer load"


# How long the hub may take to answer before a model verl reads in the driver counts as out of reach.
HUB_ANSWER_S = 5


def is_hub_id(path: str) -> bool:
    return "://" not in path and not looks_local(path) and not Path(path.split("/")[0]).is_dir()


def hub_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def hub_answers(timeout: float = HUB_ANSWER_S) -> bool:
    """Whether the Hugging Face endpoint (``HF_ENDPOINT``'s, or huggingface.co) answers at all, in seconds."""
    from huggingface_hub import constants

    try:
        urllib.request.urlopen(constants.ENDPOINT, timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # an answer, if not a page
    except (OSError, ValueError):  # no name, no route, refused, timed out
        return False
    return True


def cached_snapshot(name: str) -> str | None:
    """The folder of a hub model's snapshot in this machine's Hugging Face cache (no network), or None."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001  huggingface_hub raises several kinds for "not here"
        return None


def check_hub_model(key: str, name: str, chat_template: str | None = None) -> str:
    snapshot = cached_snapshot(name) if hub_cached(name) else None
    if snapshot is not None:
        check_tokenizer(key, snapshot, chat_template)
        return f"{key}={name}: in this machine's Hugging Face cache; model and tokenizer load"
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ValueError(f"{key}={name} is a hub model that is not in this machine's Hugging Face cache, and "
                         f"HF_HUB_OFFLINE is set: download it first, or set MODEL_PATH to a local copy")
    return f"{key}={name}: a hub model, not cached here: every node downloads it when the run starts"


def check_models_verl_reads(config: Any) -> None:
    """verl's configuration check reads the critic's model configuration in the driver (PPO): a hub model
    not cached here is fetched there, and where the hub does not answer transformers retries for about a
    minute and then fails with a traceback. Refused first, in seconds."""
    from huggingface_hub import constants
    from verl.trainer.ppo.utils import need_critic

    if not need_critic(config):
        return
    name = str(config.critic.model.path)
    if not is_hub_id(name) or hub_cached(name):
        return
    check_hub_model("critic.model.path", name)  # HF_HUB_OFFLINE: refused with its own reason
    if not hub_answers():
        raise ValueError(f"critic.model.path={name} is a hub model that is not in this machine's Hugging Face cache, "
                         f"and the hub ({constants.ENDPOINT}) did not answer within {HUB_ANSWER_S} s; verl reads the "
                         f"critic's configuration before Ray starts: download the model first, or set MODEL_PATH to a "
                         f"local copy")


def check_tokenizer(key: str, folder: str, chat_template: str | None) -> None:
    """The tokenizer loads and renders a prompt with the run's template, as verl's dataset will."""
    from verl.utils import hf_tokenizer

    try:
        tokenizer = hf_tokenizer(folder)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1"}], add_generation_prompt=True, tokenize=False)
    except Exception as error:  # transformers raises many types for a broken folder or template
        raise ValueError(f"{key}={folder}: the tokenizer does not load or render a prompt: "
                         f"{type(error).__name__}: {error}") from error


# --- data ---------------------------------------------------------------------------------------------


def as_list(files: Any) -> list[str]:
    if files is None:
        return []
    return [str(files)] if isinstance(files, (str, os.PathLike)) else [str(file) for file in files]


def check_data_files(config: Any) -> list[str]:
    """Each parquet file exists and has the column the prompt is read from."""
    import pyarrow.parquet as pq

    prompt_key = config.data.get("prompt_key", "prompt")
    report = []
    for key in ("data.train_files", "data.val_files"):
        for file in as_list(config.data.get(key.split(".")[1], None)):
            if "://" in file:
                report.append(f"{key}: {file}: a remote path, not checked here")
                continue
            path = Path(file).expanduser()
            if not path.is_file():
                raise ValueError(f"{key}: {file}: no such file (scripts/prepare_data.sh writes the cluster settings' "
                                 f"data under DATA_DIR, default ~/data/spo; DATA_DIR={os.environ.get('DATA_DIR', 'unset')})")
            try:
                schema = pq.read_schema(path)
                rows = pq.read_metadata(path).num_rows
            except Exception as error:
                raise ValueError(f"{key}: {file} is not a readable parquet file: {type(error).__name__}: {error}") from error
            if prompt_key not in schema.names:
                raise ValueError(f"{key}: {file} has no column data.prompt_key={prompt_key} (its columns: "
                                 f"{sorted(schema.names)})")
            report.append(f"{key}: {file}: {rows} rows" + overlong_prompts(config, key, path, rows))
    return report


def prompt_tokenizer(config: Any):
    """The tokenizer verl's dataset renders prompts with (the model's, with the setting's template), or None
    where it is not on this machine (a hub model not cached)."""
    from verl.utils import hf_tokenizer

    model = config.actor_rollout_ref.model
    path = str(model.get("tokenizer_path", None) or model.path)
    if is_hub_id(path):
        path = cached_snapshot(path) or path
    if "://" in path or not Path(path).expanduser().is_dir():
        return None
    tokenizer = hf_tokenizer(str(Path(path).expanduser()))
    template = model.get("custom_chat_template", None)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def overlong_prompts(config: Any, key: str, path: Path, rows: int) -> str:
    """How many of a file's prompts verl's overlong-prompt filter drops (``data.filter_overlong_prompts``:
    rendered longer than ``data.max_prompt_length``), as a clause of the file's report line; refused when
    it would drop every row (verl would then start on an empty dataset)."""
    data = config.data
    if not data.get("filter_overlong_prompts", False):
        return ""
    tokenizer = prompt_tokenizer(config)
    if tokenizer is None:
        return "; prompt lengths not counted (the tokenizer is not on this machine)"
    import pyarrow.parquet as pq

    limit = data.max_prompt_length
    prompts = pq.read_table(path, columns=[data.get("prompt_key", "prompt")]).column(0).to_pylist()
    lengths = [len(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for messages in prompts]
    dropped = sum(length > limit for length in lengths)
    if dropped == rows:
        raise ValueError(f"{key}: {path}: every prompt is longer than data.max_prompt_length={limit} tokens (the "
                         f"shortest has {min(lengths)}): verl's overlong-prompt filter would leave no data")
    return f", {dropped} longer than data.max_prompt_length={limit} (verl's overlong-prompt filter drops them)"


# --- attention ----------------------------------------------------------------------------------------


def check_attention(config: Any, torch_module=None) -> list[str]:
    """verl drops padding from its forward passes (``use_remove_padding``) by packing a micro-batch's rows
    into one sequence; only flash-attn's kernel keeps them apart (transformers' sdpa lets each row attend
    to the rows before it). flash-attn is a CUDA build: required where this Python's torch is one."""
    model = config.actor_rollout_ref.model
    attention = (model.get("override_config", None) or {}).get("attn_implementation", VERLS_ATTENTION)
    remove_padding = bool(model.get("use_remove_padding", False))
    if remove_padding and attention != VERLS_ATTENTION and needs_gpu(config):
        raise ValueError(f"actor_rollout_ref.model.use_remove_padding=true needs attn_implementation={VERLS_ATTENTION} "
                         f"(actor_rollout_ref.model.override_config.attn_implementation={attention} would let packed rows "
                         f"attend to each other): set use_remove_padding=false or use {VERLS_ATTENTION}")
    if attention != VERLS_ATTENTION:
        return [f"attention: {attention}"]
    if torch_module is None:
        import torch as torch_module
    if torch_module.version.cuda is None:
        return [f"attention: {VERLS_ATTENTION}; flash-attn not checked: this Python's torch {torch_module.__version__} "
                f"is a CPU build (the GPU Python needs: {FLASH_ATTN_INSTALL})"]
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(f"actor_rollout_ref.model.override_config.attn_implementation={VERLS_ATTENTION} needs flash-attn, "
                         f"which this Python does not have: {FLASH_ATTN_INSTALL}")
    # Installed is not enough: a build against another torch or CUDA fails when its kernels load, in every
    # actor, minutes into the run.
    try:
        importlib.import_module("flash_attn")
    except Exception as error:  # an ImportError, or an OSError of the shared library
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(f"actor_rollout_ref.model.override_config.attn_implementation={VERLS_ATTENTION} needs flash-attn, "
                         f"which is installed but does not import in this Python ({reason}); rebuild it against this "
                         f"torch: pip uninstall -y flash-attn && {FLASH_ATTN_INSTALL}") from error
    return [f"attention: {VERLS_ATTENTION} (flash-attn imports)"]
