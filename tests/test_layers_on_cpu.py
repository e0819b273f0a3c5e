"""The package's three layers (docs/LAYOUT.md) and the direction of their imports: the SPO core imports
neither verl nor vLLM, Ray or TransferQueue, nor anything of the package outside the core; the verl
adapters import no tool; nothing of the installed package imports the repository's workbench
(``spo_workbench``: studies, report, credit command, benchmarks, test harness), and a wheel built from
``pyproject.toml`` holds none of it."""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spo_verl"
WORKBENCH = REPO / "workbench" / "spo_workbench"

# Each layer is a folder of the package; at its top only the package itself and verl's plugin entry point.
CORE, ADAPTERS, TOOLS = "spo_verl.core", "spo_verl.adapters", "spo_verl.tools"
ENTRY_POINTS = {"spo_verl", "spo_verl.register"}
FRAMEWORKS = ("verl", "vllm", "ray", "transfer_queue")


def _name(path: Path, root: Path = REPO) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _layer(module: str) -> str:
    """The layer of a module of the package; the entry points count as adapters (they import verl)."""
    if module == CORE or module.startswith(CORE + "."):
        return "core"
    if module == TOOLS or module.startswith(TOOLS + "."):
        return "tool"
    return "adapter"


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
WORKBENCH_MODULES = {_name(path, WORKBENCH.parent): _imports(path) for path in sorted(WORKBENCH.rglob("*.py"))}


def test_every_module_lies_in_a_layers_folder_but_the_entry_points():
    outside = {module for module in MODULES if not module.startswith((CORE, ADAPTERS, TOOLS))}
    assert outside == ENTRY_POINTS
    for layer in (CORE, ADAPTERS, TOOLS):
        assert sum(module.startswith(layer + ".") for module in MODULES) >= 5, layer


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


def test_adapters_import_no_tool_and_the_package_imports_no_workbench_module():
    adapter_to_tool = {(module, imported) for module, imports in MODULES.items() if _layer(module) == "adapter"
                       for imported in imports if imported.startswith("spo_verl.") and _layer(imported) == "tool"}
    assert not adapter_to_tool, sorted(adapter_to_tool)
    assert {"spo_workbench.testing.verl_server", "spo_workbench.credit.gradients",
            "spo_workbench.study.compare", "spo_workbench.benchmarks.gpu_check"} <= set(WORKBENCH_MODULES)
    to_workbench = {(module, imported) for module, imports in MODULES.items() for imported in imports
                    if imported.split(".")[0] == "spo_workbench"}
    assert not to_workbench, sorted(to_workbench)
    recipe = {(str(path.relative_to(REPO)), imported) for path in sorted((REPO / "recipe").rglob("*.py"))
              for imported in _imports(path) if imported.split(".")[0] == "spo_workbench"}
    assert not recipe, sorted(recipe)


def test_a_wheel_of_the_plugin_holds_the_plugin_and_no_workbench_module(tmp_path):
    import shutil
    import zipfile

    # Built from a copy of what the project's packaging reads, so no earlier build folder can add to it.
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "spo_verl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(WORKBENCH.parent, source / "workbench", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("spo_verl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {name.removesuffix(".py").replace("/", ".") for name in names if name.endswith(".py")}
    assert {"spo_verl.register", "spo_verl.adapters.estimators", "spo_verl.adapters.cpu_platform.platform",
            "spo_verl.tools.cpu_settings.smollm2", "spo_verl.tools.data.prepare", "spo_verl.tools.run_summary",
            "spo_verl.tools.gpu_environment"} <= modules
    assert not [m for m in modules if m.split(".")[0] != "spo_verl"]
    assert not [m for m in modules if m.startswith(("spo_verl.tools.study", "spo_verl.tools.report",
                                                    "spo_verl.tools.credit", "spo_verl.tools.benchmarks",
                                                    "spo_verl.tools.testing"))]


def test_every_file_of_the_package_the_docs_name_exists_and_has_the_lines_they_cite():
    cited = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "recipe").rglob("*.md"))]:
        for path, line in re.findall(r"((?:spo_verl|workbench/spo_workbench)/[\w/]+\.py)(?::(\d+))?", doc.read_text()):
            cited.add((doc.name, path, int(line or 0)))
    assert len(cited) > 50
    missing = sorted((doc, path) for doc, path, _ in cited if not (REPO / path).is_file())
    assert not missing
    beyond = sorted((doc, path, line) for doc, path, line in cited
                    if line > len((REPO / path).read_text().splitlines()))
    assert not beyond


def test_the_tools_find_the_repository_they_run_from():
    import spo_verl.tools

    assert spo_verl.tools.REPO == REPO and (REPO / "scripts" / "spo_launch.sh").is_file()
