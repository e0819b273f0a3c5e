"""Shared fixtures: one tiny Qwen2 model, and verl's own vLLM rollout server on CPU for the whole test
session (``spo_verl/testing/verl_server.py``: Ray, one standalone ``vLLMReplica`` and verl's
``LLMServerClient``; about a minute to start on two cores).

The server is lazy: it starts when the first test that asks for ``verl_server``, ``llm_client`` or
``recording_client`` runs, and those tests run after all others (see
:func:`pytest_collection_modifyitems`), so Ray runs in the pytest process only at the end, after the
tests that start and stop Ray themselves. Async tests that use the server run in the session event
loop: mark them with ``pytest.mark.asyncio(loop_scope="session")``."""

from pathlib import Path

import pytest
import pytest_asyncio

from spo_verl.testing import verl_server as verl_server_module
from spo_verl.cpu_settings.tiny_model import build_tiny_qwen2, build_tiny_tokenizer

SERVER_FIXTURE = "verl_server"


def pytest_collection_modifyitems(session, config, items):
    """Tests that use verl's server (and so the in-process Ray it starts) run last, in their order."""
    others = [item for item in items if SERVER_FIXTURE not in getattr(item, "fixturenames", ())]
    users = [item for item in items if SERVER_FIXTURE in getattr(item, "fixturenames", ())]
    items[:] = others + users


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tiny_tokenizer(directory)
    build_tiny_qwen2(directory, tokenizer, seed=0)
    return str(directory), tokenizer


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """The cpu-smollm2 setting's model folder and data, converted once per session (~40 s)."""
    from spo_verl.cpu_settings import smollm2 as cpu_smollm2

    folder = tmp_path_factory.mktemp("cpu-smollm2")
    paths = cpu_smollm2.build(folder)
    return {"folder": folder, "model_dir": Path(paths["model"]), "train_files": paths["train_files"],
            "val_files": paths["val_files"]}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def verl_server(tiny_model):
    """verl's vLLM server replica for the tiny model (:class:`spo_verl.testing.verl_server.VerlServer`)."""
    server = await verl_server_module.start_verl_server(tiny_model[0])
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture
def llm_client(verl_server):
    """verl's ``LLMServerClient`` for the session's server (what verl's agent loops call)."""
    return verl_server.client


@pytest.fixture
def recording_client(verl_server):
    """A fresh :class:`spo_verl.testing.verl_server.RecordingClient` around a new verl ``LLMServerClient``: calls go
    through to verl's server; ``.calls`` records this test's calls."""
    return verl_server.recording_client()
