"""Every command the README and the docs show names something that exists: each ``bash scripts/<name>.sh`` is a
script of the repository and each ``python -m <module>`` an importable module with a ``__main__``
(the commands themselves run in tests/test_end_to_end_on_cpu.py: the run script, the study's quick
mode and --help, the report)."""

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


def readme_commands() -> list[str]:
    text = "".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    lines = [line for block in CODE_BLOCK.findall(text) for line in block.splitlines()]
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_every_script_and_module_the_readme_runs_exists():
    commands = readme_commands()
    scripts = {m for c in commands for m in re.findall(r"bash (scripts/[\w./-]+\.sh)", c)}
    modules = {m for c in commands for m in re.findall(r"python -m ([\w.]+)", c)}
    assert {"scripts/setup_env.sh", "scripts/run_tests.sh", "scripts/run_spo_tree.sh", "scripts/compare.sh"} <= scripts
    assert "spo_workbench.report" in modules
    missing = sorted(s for s in scripts if not (REPO / s).is_file())
    assert not missing, f"the docs run scripts that do not exist: {missing}"
    for module in modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"the docs run python -m {module}, which is not importable"
        if spec.submodule_search_locations:  # a package: python -m needs its __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation other than '-' and '_' dropped,
    spaces made hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_docs_link_only_to_files_of_the_repository():
    link = re.compile(r"\]\(([^)#]*)(?:#([^)]*))?\)")
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target, anchor in link.findall(page.read_text()):
            if "://" in target:
                continue
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.relative_to(REPO)} links to {target}, which does not exist"
            if anchor:
                assert anchor in heading_anchors(linked), (
                    f"{page.relative_to(REPO)} links to {target}#{anchor}, a heading {linked.name} does not have"
                )
