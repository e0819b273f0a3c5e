"""verl finds SPO's names in a fresh process by each documented route (its entry-point errors are silent)."""

import os
import subprocess
import sys


CHECK = (
    "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY; "
    "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as AGENT_LOOPS; "
    "print(sorted(n for n in ADV_ESTIMATOR_REGISTRY if n.startswith('spo')), "
    "sorted(n for n in POLICY_LOSS_REGISTRY if n.startswith('spo')), "
    "sorted(n for n in AGENT_LOOPS if n.startswith('spo')))"
)
REGISTERED = "['spo_chain', 'spo_tree'] ['spo_prob_mask'] ['spo_chain', 'spo_episode', 'spo_tree']"


def run_python(code, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    environment.update(env)
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_plain_import_verl_registers_everything_through_the_entry_point():
    code = (
        "import verl; from verl.trainer.ppo.core_algos import get_adv_estimator_fn as g, get_policy_loss_fn as l; "
        "g('spo_tree'); g('spo_chain'); l('spo_prob_mask'); " + CHECK
    )
    assert run_python(code) == REGISTERED


def test_without_plugins_nothing_is_registered():
    assert run_python("import verl; " + CHECK, VERL_USE_EXTERNAL_PLUGINS="none") == "[] [] []"


def test_verl_use_external_modules():
    out = run_python("import verl; " + CHECK, VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="spo_verl.register")
    assert out == REGISTERED


def test_external_lib_hook():
    # actor_rollout_ref.model.external_lib goes through verl's import_external_libs in every worker.
    code = "import verl; from verl.utils.import_utils import import_external_libs; import_external_libs('spo_verl.register'); " + CHECK
    assert run_python(code, VERL_USE_EXTERNAL_PLUGINS="none") == REGISTERED


def test_double_import_is_harmless():
    code = "import verl, importlib, spo_verl.register; importlib.reload(spo_verl.register); " + CHECK
    assert run_python(code) == REGISTERED


def test_the_task_runners_module_registers_everything_itself():
    # The process Ray starts for a TaskRunner imports the runner's module, where verl's plugins may be off.
    code = "import spo_verl.adapters.trainer.runners; " + CHECK
    assert run_python(code, VERL_USE_EXTERNAL_PLUGINS="none") == REGISTERED
