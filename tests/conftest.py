"""Shared fixtures: one tiny Qwen2 model, and verl's own vLLM rollout server on CPU for the whole test
session (``workbench/spo_workbench/testing/verl_server.py``: Ray, one standalone ``vLLMReplica`` and verl's
``LLMServerClient``; about a minute to start on two cores).

The suite runs in three tiers, so that a broken unit costs minutes, not the whole run
(:func:`pytest_collection_modifyitems`): the unit and seam tests; then the tests that use verl's server
(it starts lazily when the first of them runs, so Ray runs in the pytest process only after the tests
that start and stop Ray themselves); then the end-to-end runs of verl's whole trainer
(``@pytest.mark.end_to_end``), which start only when every test before them passed, after the server is
shut down. Async tests that use the server run in the session event loop: mark them with
``pytest.mark.asyncio(loop_scope="session")``.

Where vLLM is not installed (``scripts/test_gpu_user_versions.sh`` runs the suite on a GPU user's torch
and transformers without it), the tests that need it are deselected, counted and named at the end of
the session (:func:`needs_vllm`): the end-to-end runs, the tests that use verl's server, and those
marked ``@pytest.mark.needs_vllm``. Every other test runs as usual.

Each end-to-end run records its wall time and phases through :func:`run_times`; the table is printed
at the end of the session (tests/README.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import pytest_asyncio

from spo_workbench.testing import verl_server as verl_server_module
from recipe.spo.cpu_settings.tiny_model import build_tiny_qwen2, build_tiny_tokenizer

SERVER_FIXTURE = "verl_server"
END_TO_END = "end_to_end"
NEEDS_VLLM = "needs_vllm"
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
RUN_TIMES = pytest.StashKey[Path]()
DESELECTED_NEEDING_VLLM = pytest.StashKey[list]()
RUNNING_SERVERS: list = []  # verl servers this session started and has not shut down


def pytest_addoption(parser):
    parser.addoption("--needs-vllm-list", metavar="PATH",
                     help="write the ids of the tests deselected because vLLM is not installed to PATH, one a line")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{END_TO_END}: a run of verl's whole trainer through the run scripts "
                                       "(minutes; the fast tier deselects them with -m 'not end_to_end')")
    config.addinivalue_line("markers", f"{NEEDS_VLLM}: the test starts or imports vLLM; deselected, and named at the "
                                       "end, where vLLM is not installed")
    config.stash[DESELECTED_NEEDING_VLLM] = []


def needs_vllm(item) -> bool:
    """The end-to-end runs train through vLLM and the server's tests talk to it: both need it without
    a mark of their own."""
    return bool(item.get_closest_marker(NEEDS_VLLM) or item.get_closest_marker(END_TO_END)
                or SERVER_FIXTURE in getattr(item, "fixturenames", ()))


def _tier(item) -> int:
    if item.get_closest_marker(END_TO_END):
        return 2
    return 1 if SERVER_FIXTURE in getattr(item, "fixturenames", ()) else 0


@pytest.hookimpl(trylast=True)  # after -m and -k, so that only tests they kept count as deselected here
def pytest_collection_modifyitems(session, config, items):
    """Unit and seam tests first, then the tests that use verl's server, then the end-to-end runs;
    each tier keeps its order. pytest-xdist's workers (scripts/run_tests.sh) take tests in this order
    too, each its share: a worker starts its own server at its first server test, after any test it
    runs that starts and stops Ray in the process itself.

    Without vLLM the tests that need it would fail for want of it, hiding what else fails: they are
    deselected instead and named in the summary (pytest-xdist's workers hand their list to the
    controller, which prints it)."""
    if not VLLM_INSTALLED:
        needing = [item for item in items if needs_vllm(item)]
        if needing:
            items[:] = [item for item in items if not needs_vllm(item)]
            config.hook.pytest_deselected(items=needing)
            config.stash[DESELECTED_NEEDING_VLLM] = [item.nodeid for item in needing]
            if hasattr(config, "workeroutput"):  # a pytest-xdist worker
                config.workeroutput[NEEDS_VLLM] = config.stash[DESELECTED_NEEDING_VLLM]
    items.sort(key=_tier)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on its controller
def pytest_testnodedown(node, error):
    """Every worker collects the whole suite and so deselects the same tests; the first list in is kept."""
    listed = getattr(node, "workeroutput", {}).get(NEEDS_VLLM)
    if listed and not node.config.stash[DESELECTED_NEEDING_VLLM]:
        node.config.stash[DESELECTED_NEEDING_VLLM] = listed


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures are set up
def pytest_runtest_setup(item):
    """The end-to-end runs start their own Ray and vLLM: the session's server (memory, a Ray instance
    in this process) is no longer needed by then (no server test runs after them)."""
    if item.get_closest_marker(END_TO_END):
        while RUNNING_SERVERS:
            RUNNING_SERVERS.pop().shutdown()


class RunTimes:
    """Wall time and phases of each end-to-end run, one JSON line each in ``path``."""

    COLUMNS = ("wall_s", "start_up_s", "steps_s", "validation_s", "checkpoint_s", "steps")

    def __init__(self, path: Path):
        self.path = path

    def record(self, run: str, **phases) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"run": run, **phases}) + "\n")


@pytest.fixture(scope="session")
def run_times(request, tmp_path_factory) -> RunTimes:
    path = tmp_path_factory.getbasetemp() / "end_to_end_run_times.jsonl"
    request.config.stash[RUN_TIMES] = path
    return RunTimes(path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _report_deselected_needing_vllm(terminalreporter, config)
    _report_run_times(terminalreporter, config)


def _report_deselected_needing_vllm(terminalreporter, config) -> None:
    deselected = config.stash[DESELECTED_NEEDING_VLLM]
    listed = config.getoption("--needs-vllm-list")
    if listed:
        Path(listed).write_text("".join(f"{nodeid}\n" for nodeid in deselected))
    if deselected:
        terminalreporter.section(f"deselected: {len(deselected)} tests that need vLLM, which is not installed")
        for nodeid in deselected:
            terminalreporter.write_line(nodeid)


def _report_run_times(terminalreporter, config) -> None:
    path = config.stash.get(RUN_TIMES, None)
    if path is None or not path.exists():
        return
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    terminalreporter.section("end-to-end runs: seconds by phase (start-up includes shutdown)")
    terminalreporter.write_line(f"{'run':<36}" + "".join(f"{c.removesuffix('_s'):>12}" for c in RunTimes.COLUMNS))
    for row in rows:
        terminalreporter.write_line(f"{row['run']:<36}" + "".join(f"{row.get(c, 0):>12.0f}" for c in RunTimes.COLUMNS))
    total = sum(row["wall_s"] for row in rows)
    terminalreporter.write_line(f"{len(rows)} runs, {total:.0f} s of run time in all (several run at once)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tiny_tokenizer(directory)
    build_tiny_qwen2(directory, tokenizer, seed=0)
    return str(directory), tokenizer


@pytest.fixture
def cpu_tiny_cache(tiny_model, tmp_path):
    """A cpu-tiny cache folder (recipe/spo/cpu_settings/cache.py) around the session's tiny model, without
    the setting's fine-tuning: for what never loads the model (a run refused before Ray) or
    loads it into the session's server."""
    from recipe.spo.cpu_settings import tiny

    cache = tmp_path / "cpu-tiny"
    cache.mkdir()
    (cache / "model").symlink_to(tiny_model[0])
    tiny.write_data(cache / "data")
    (cache / "built.json").write_text(json.dumps({"version": tiny.VERSION}))
    return cache


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """The cpu-smollm2 setting's model folder and data, converted once per session (~40 s)."""
    from recipe.spo.cpu_settings import smollm2 as cpu_smollm2

    folder = tmp_path_factory.mktemp("cpu-smollm2")
    paths = cpu_smollm2.build(folder)
    return {"folder": folder, "model_dir": Path(paths["model"]), "train_files": paths["train_files"],
            "val_files": paths["val_files"]}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def verl_server(tiny_model):
    """verl's vLLM server replica for the tiny model (:class:`spo_workbench.testing.verl_server.VerlServer`)."""
    server = await verl_server_module.start_verl_server(tiny_model[0])
    RUNNING_SERVERS.append(server)
    try:
        yield server
    finally:
        if server in RUNNING_SERVERS:
            RUNNING_SERVERS.remove(server)
            server.shutdown()


@pytest.fixture
def llm_client(verl_server):
    """verl's ``LLMServerClient`` for the session's server (what verl's agent loops call)."""
    return verl_server.client


@pytest.fixture
def recording_client(verl_server):
    """A fresh :class:`spo_workbench.testing.verl_server.RecordingClient` around a new verl ``LLMServerClient``: calls go
    through to verl's server; ``.calls`` records this test's calls."""
    return verl_server.recording_client()


@pytest.fixture
def compose_setting():
    """``compose_setting(setting, algorithm, *overrides)``: the recipe's configuration as the launcher composes
    it, unresolved (a CPU setting gets stand-ins for its builder's data files)."""
    from hydra import compose, initialize_config_dir

    from spo_verl.adapters import config_resolvers

    config_resolvers.install()  # the recipe's resolvers, for the callers that resolve it
    config_dir = str(Path(__file__).resolve().parents[1] / "recipe" / "spo" / "config")

    def composed(setting: str, algorithm: str, *overrides: str):
        built = ["data.train_files=t.parquet", "data.val_files=v.parquet"] if setting.startswith("cpu-") else []
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="spo_trainer",
                           overrides=[f"setting={setting}", f"spo_algorithm={algorithm}", *built, *overrides])

    return composed
