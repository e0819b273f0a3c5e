"""Shared fixtures: one tiny Qwen2 model and one real vLLM CPU engine for the whole test session
(an engine takes ~20 s to start on two cores). Async tests that use the engine run in the session
event loop: mark their module with ``pytestmark = pytest.mark.asyncio(loop_scope="session")``."""

import pytest
import pytest_asyncio

from spo_verl.testing.tiny_vllm import CPUvLLMServer, build_tiny_qwen2, build_tiny_tokenizer

ENGINE_MAX_MODEL_LEN = 1024
ENGINE_PROMPT_LENGTH = 64
ENGINE_RESPONSE_LENGTH = 48


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tiny_tokenizer(directory)
    build_tiny_qwen2(directory, tokenizer, seed=0)
    return str(directory), tokenizer


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_server(tiny_model):
    model_dir, _ = tiny_model
    server = await CPUvLLMServer.start(
        model_dir,
        seed=0,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        prompt_length=ENGINE_PROMPT_LENGTH,
        response_length=ENGINE_RESPONSE_LENGTH,
    )
    try:
        yield server
    finally:
        await server.shutdown()
