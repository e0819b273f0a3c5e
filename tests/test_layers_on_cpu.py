"""The installed plugin and what lies around it (docs/LAYOUT.md), and the direction of their imports.

The plugin (``spo_verl``) is two layers, the SPO core (no verl, vLLM, Ray or TransferQueue, nothing of the
package outside the core) and the verl adapters, with verl's entry point ``spo_verl.register`` on top; a
wheel built from ``pyproject.toml`` holds those and nothing else. The recipe (``recipe/spo``: entry point,
checks before Ray, launch helpers) uses the plugin; the workbench (``spo_workbench``: studies, report,
credit command, gradient measurement, benchmarks, test harness) uses both; the plugin imports neither,
and the recipe imports no workbench module."""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "spo_verl"
RECIPE = REPO / "recipe" / "spo"
WORKBENCH = REPO / "workbench" / "spo_workbench"

# Each layer is a folder of the package; at its top only the package itself and verl's plugin entry point.
CORE, ADAPTERS = "spo_verl.core", "spo_verl.adapters"
ENTRY_POINTS = {"spo_verl", "spo_verl.register"}
FRAMEWORKS = ("verl", "vllm", "ray", "transfer_queue")


def _name(path: Path, root: Path = REPO) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _is_core(module: str) -> bool:
    return module == CORE or module.startswith(CORE + ".")


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
RECIPE_MODULES = {_name(path): _imports(path) for path in sorted(RECIPE.rglob("*.py"))}
WORKBENCH_MODULES = {_name(path, WORKBENCH.parent): _imports(path) for path in sorted(WORKBENCH.rglob("*.py"))}


def test_every_module_of_the_plugin_lies_in_the_core_or_the_adapters_but_the_entry_points():
    outside = {module for module in MODULES if not module.startswith((CORE + ".", ADAPTERS + "."))}
    assert outside == ENTRY_POINTS | {CORE, ADAPTERS}
    for layer in (CORE, ADAPTERS):
        assert sum(module.startswith(layer + ".") for module in MODULES) >= 5, layer


def test_the_core_imports_no_framework_and_nothing_outside_the_core():
    wrong = {(module, imported) for module, imports in MODULES.items() if _is_core(module)
             for imported in imports
             if imported.split(".")[0] in FRAMEWORKS or (imported.startswith("spo_verl.") and not _is_core(imported))}
    assert not wrong, sorted(wrong)


def test_importing_the_whole_core_loads_no_framework():
    core = [module for module in MODULES if _is_core(module)]
    loaded = subprocess.run(
        [sys.executable, "-c", "import importlib, sys\n"
                               f"for m in {core!r}: importlib.import_module(m)\n"
                               f"print(sorted(k for k in sys.modules if k.split('.')[0] in {FRAMEWORKS!r}))"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]"


def test_the_plugin_imports_neither_the_recipe_nor_the_workbench_and_no_adapter_imports_the_entry_point():
    outward = {(module, imported) for module, imports in MODULES.items() for imported in imports
               if imported.split(".")[0] in ("recipe", "spo_workbench")}
    assert not outward, sorted(outward)
    # verl's entry point installs the adapters; an adapter importing it would run back up to the top.
    to_entry = {(module, imported) for module, imports in MODULES.items() if module.startswith(ADAPTERS + ".")
                for imported in imports if imported in ("spo_verl", "spo_verl.register")}
    assert not to_entry, sorted(to_entry)
    assert {"spo_workbench.testing.verl_server", "spo_workbench.credit.gradients",
            "spo_workbench.study.compare", "spo_workbench.benchmarks.gpu_check"} <= set(WORKBENCH_MODULES)
    recipe_to_workbench = {(module, imported) for module, imports in RECIPE_MODULES.items() for imported in imports
                           if imported.split(".")[0] == "spo_workbench"}
    assert not recipe_to_workbench, sorted(recipe_to_workbench)
    assert {"recipe.spo.main_spo", "recipe.spo.cpu_settings.smollm2", "recipe.spo.data.prepare",
            "recipe.spo.run_summary", "recipe.spo.rehearsal.build"} <= set(RECIPE_MODULES)


def test_a_wheel_of_the_plugin_holds_the_plugin_and_nothing_else(tmp_path):
    import shutil
    import zipfile

    # Built from a copy of what the project's packaging reads, with the recipe and the workbench beside it,
    # so no earlier build folder can add to it and nothing beside the package can slip in.
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source / "spo_verl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "recipe", source / "recipe", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(WORKBENCH.parent, source / "workbench", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("spo_verl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {name.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for name in names if name.endswith(".py")}
    # Exactly the plugin's modules: the core, the adapters (the CPU platform among them) and the entry point.
    assert modules == set(MODULES)
    assert {"spo_verl.register", "spo_verl.adapters.estimators", "spo_verl.adapters.cpu_platform.platform",
            "spo_verl.core.algorithms.tree_rows"} <= modules


def test_every_file_of_the_package_the_docs_name_exists_and_has_the_lines_they_cite():
    cited = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "recipe").rglob("*.md"))]:
        for path, line in re.findall(r"((?:spo_verl|workbench/spo_workbench|recipe/spo)/[\w/]+\.py)(?::(\d+))?", doc.read_text()):
            cited.add((doc.name, path, int(line or 0)))
    assert len(cited) > 50
    missing = sorted((doc, path) for doc, path, _ in cited if not (REPO / path).is_file())
    assert not missing
    beyond = sorted((doc, path, line) for doc, path, line in cited
                    if line > len((REPO / path).read_text().splitlines()))
    assert not beyond


def test_the_recipe_finds_the_checkout_it_runs_from():
    from recipe.spo import REPO as recipe_repo

    assert recipe_repo == REPO and (REPO / "scripts" / "spo_launch.sh").is_file()
