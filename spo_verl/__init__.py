"""Segment Policy Optimization (SPO) for verl, in three layers (docs/LAYOUT.md): ``core`` (SPO itself, no
verl), ``adapters`` (SPO in verl) and ``tools`` (study, report, credit command, benchmarks, CPU settings);
``register`` is verl's plugin entry point."""

import importlib.abc
import sys

__version__ = "0.1.0"

# The modules' names before the package was split into layers, each with its new place: importing an old
# name (``python -m spo_verl.credit``, ``pkg://spo_verl.rewards``) fails with a message naming the new one.
MOVED_MODULES = dict(pair.split("=") for pair in """
    algorithms=core.algorithms rollout=core.rollout config=core.config metadata=core.metadata
    batch_context=core.batch_context packing.engine=adapters.packing.engine
    packing.micro_batches=adapters.packing.micro_batches packing=core.packing credit.blame=core.credit.blame
    credit.online=core.credit.online cpu_settings.answer_errors=core.credit.answer_errors credit=tools.credit
    cpu_settings=tools.cpu_settings estimators=adapters.estimators policy_loss=adapters.policy_loss
    rewards=adapters.rewards agent_loops=adapters.agent_loops trainer=adapters.trainer
    cpu_platform=adapters.cpu_platform study_table=tools.study.table study_verdict=tools.study.verdict
    task_calibration=tools.study.calibration study=tools.study.compare run_summary=tools.run_summary
    metrics_log=tools.metrics_log gpu_environment=tools.gpu_environment report=tools.report
    benchmarks=tools.benchmarks data=tools.data testing=tools.testing""".split())


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for a name no other finder found."""

    def find_spec(self, name, path=None, target=None):
        relative = name.removeprefix(__name__ + ".")
        old = max((old for old in MOVED_MODULES if relative == old or relative.startswith(old + ".")), key=len,
                  default=None)
        if relative != name and old:
            new = f"{__name__}.{MOVED_MODULES[old]}{relative[len(old):]}"
            raise ModuleNotFoundError(f"{name} has moved: it is now {new}", name=name)
        return None


sys.meta_path.append(_MovedModuleFinder())
