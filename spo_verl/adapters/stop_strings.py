"""Stop strings for every request a rollout server serves: ``actor_rollout_ref.rollout.custom.stop``.

verl 0.9.1's agent loops build each request's sampling parameters from a fixed list (temperature, top-p,
top-k, repetition penalty, log-probs), so a setting cannot ask for stop strings. The SPO reference stops
RhoMath-1.1B at ``"\\n\\n\\nProblem:"``: the SFT model writes the next problem after its answer. So verl's
vLLM server adds the setting's stop strings to every request that does not name its own (rollouts,
Monte Carlo continuations, validation), in every agent loop, verl's included.

vLLM cuts its text at the stop string but not its token ids, and verl trains and decodes the token ids:
the stop string's tokens end the response. The reward (``spo_verl.adapters.rewards``, ``stop``) reads
the text before it, as the reference's reward does.
"""

from __future__ import annotations

from typing import Any

from spo_verl.adapters.import_hooks import after_import

SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"


def stop_strings(rollout_config: Any) -> list[str]:
    """The setting's stop strings (``rollout.custom.stop``), [] for none."""
    custom = rollout_config.get("custom", None) if rollout_config is not None else None
    stop = (custom or {}).get("stop", None)
    if stop is None:
        return []
    if isinstance(stop, str) or not all(isinstance(item, str) and item for item in stop):
        raise ValueError(f"actor_rollout_ref.rollout.custom.stop must be a list of non-empty strings, got {stop!r}")
    return list(stop)


def with_stop_strings(sampling_params: dict, rollout_config: Any) -> dict:
    """``sampling_params`` with the setting's stop strings, unless the request names its own."""
    stop = stop_strings(rollout_config)
    if not stop or "stop" in sampling_params:
        return sampling_params
    return {**sampling_params, "stop": stop}


def _patch(module) -> None:
    server = module.vLLMHttpServer
    generate = server.generate
    if getattr(generate, "adds_stop_strings", False):
        return

    async def generate_with_stop_strings(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        return await generate(self, prompt_ids, with_stop_strings(sampling_params, self.config), request_id,
                              *args, **kwargs)

    generate_with_stop_strings.adds_stop_strings = True
    generate_with_stop_strings.__doc__ = generate.__doc__
    server.generate = generate_with_stop_strings


def install() -> None:
    """Patch verl's vLLM server when (and in whichever process) it is imported."""
    after_import(SERVER_MODULE, _patch)
