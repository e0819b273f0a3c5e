"""The package's three layers (docs/LAYOUT.md) and the direction of their imports: the SPO core imports
neither verl nor vLLM, Ray or TransferQueue, nor anything of the package outside the core; the verl
adapters import no tool; only tools and tests import the test harness (``spo_verl.testing``)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spo_verl"

# Module prefixes of each layer; a module in neither is a tool (study, report, benchmarks, credit
# command, CPU settings, data, test harness, launcher checks).
CORE = ("spo_verl.algorithms", "spo_verl.rollout", "spo_verl.config", "spo_verl.metadata", "spo_verl.batch_context",
        "spo_verl.packing.tree_pack", "spo_verl.packing.packed_forward", "spo_verl.packing.cascade_attention",
        "spo_verl.packing.verl_rows")
CORE_PACKAGES = ("spo_verl.packing",)  # its __init__ re-exports the core's packing only
ADAPTERS = ("spo_verl.register", "spo_verl.estimators", "spo_verl.policy_loss", "spo_verl.rewards",
            "spo_verl.agent_loops", "spo_verl.trainer", "spo_verl.cpu_platform", "spo_verl.packing.engine",
            "spo_verl.packing.micro_batches")
# The one adapter -> tool edge: the online credit metrics (spo/credit/*) use the credit command's
# measures and the CPU tasks' step checker, both free of verl; they belong in the core.
ADAPTER_USES_OF_TOOLS = {("spo_verl.trainer.credit_step", "spo_verl.cpu_settings.answer_errors"),
                         ("spo_verl.trainer.credit_step", "spo_verl.credit.blame"),
                         ("spo_verl.trainer.credit_step", "spo_verl.credit.online")}
FRAMEWORKS = ("verl", "vllm", "ray", "transfer_queue")


def _name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _layer(module: str) -> str:
    if module in CORE_PACKAGES or module.startswith(CORE):
        return "core"
    if module.startswith(ADAPTERS):
        return "adapter"
    return "tool"


def _imports(path: Path) -> set[str]:
    """Every module the file imports, at any depth of its code (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


MODULES = {_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_layer_has_modules_and_every_prefix_names_one():
    layers = {module: _layer(module) for module in MODULES}
    assert {"core", "adapter", "tool"} == set(layers.values())
    for prefix in (*CORE, *ADAPTERS):
        assert any(module == prefix or module.startswith(prefix + ".") for module in MODULES), prefix


def test_the_core_imports_no_framework_and_nothing_outside_the_core():
    wrong = {(module, imported) for module, imports in MODULES.items() if _layer(module) == "core"
             for imported in imports
             if imported.split(".")[0] in FRAMEWORKS or (imported.startswith("spo_verl.") and _layer(imported) != "core")}
    assert not wrong, sorted(wrong)


def test_importing_the_whole_core_loads_no_framework():
    core = [module for module in MODULES if _layer(module) == "core"]
    loaded = subprocess.run(
        [sys.executable, "-c", "import importlib, sys\n"
                               f"for m in {core!r}: importlib.import_module(m)\n"
                               f"print(sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r}))"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]"


def test_adapters_import_no_tool_and_only_tools_import_the_test_harness():
    adapter_to_tool = {(module, imported) for module, imports in MODULES.items() if _layer(module) == "adapter"
                       for imported in imports if imported.startswith("spo_verl.") and _layer(imported) == "tool"}
    assert adapter_to_tool == ADAPTER_USES_OF_TOOLS
    harness_users = {module for module, imports in MODULES.items()
                     if any(imported.startswith("spo_verl.testing") for imported in imports)}
    assert all(_layer(module) == "tool" for module in harness_users), sorted(harness_users)
