"""Side-by-side timing and peak memory.

Each comparison times both sides in the same process, alternating (A, B, A, B, ...) so that a slow
spell of the machine hits both, and reports the median of the per-round ratios with their spread
(the smallest and largest ratio of a round). Peak memory is measured in a fresh subprocess per case:
torch has no allocator statistics on the CPU, so it is the growth of the process's peak resident set
size (the kernel's ``VmHWM``, reset just before the measured call) over what the process held
just before it.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Comparison:
    """Seconds of each round of sides ``a`` and ``b``; ratios are ``a / b``."""

    a_seconds: list[float] = field(default_factory=list)
    b_seconds: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.a_seconds, self.b_seconds)]

    @property
    def a_median(self) -> float:
        return statistics.median(self.a_seconds)

    @property
    def b_median(self) -> float:
        return statistics.median(self.b_seconds)

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.ratios), max(self.ratios)

    def ratio_text(self, digits: int = 2) -> str:
        low, high = self.spread
        return f"{self.ratio:.{digits}f}x ({low:.{digits}f}-{high:.{digits}f})"

    def as_dict(self) -> dict:
        return {"a_seconds": self.a_seconds, "b_seconds": self.b_seconds, "ratio": self.ratio, "spread": self.spread}


def _seconds(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def compare(a: Callable[[], object], b: Callable[[], object], repeats: int, warmup: int = 1,
            inner: int = 1) -> Comparison:
    """Time ``a`` against ``b``: ``warmup`` untimed calls of each, then ``repeats`` rounds, each one
    call of ``a`` then one of ``b`` (the order swaps every round); ``inner`` calls per timed sample."""
    for _ in range(warmup):
        a(), b()
    result = Comparison()

    def sample(fn):
        return _seconds(lambda: [fn() for _ in range(inner)]) / inner

    for round_ in range(repeats):
        if round_ % 2 == 0:
            result.a_seconds.append(sample(a))
            result.b_seconds.append(sample(b))
        else:
            result.b_seconds.append(sample(b))
            result.a_seconds.append(sample(a))
    return result


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {key}")


def memory_report(module: str, cases, quick: bool, threads: int) -> dict:
    """Run ``python -m <module> --memory-cases <cases...>`` in one fresh process and return its report
    (case -> :func:`measure_memory_case`). glibc's mmap and trim thresholds are pinned at 128 KiB so a
    freed tensor leaves the resident set instead of being kept for reuse."""
    command = [sys.executable, "-m", module, "--threads", str(threads), "--memory-cases", *cases]
    if quick:
        command.append("--quick")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": "131072",
           "MALLOC_TRIM_THRESHOLD_": "131072"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"memory cases failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _release_freed_memory() -> None:
    """Collect garbage and hand glibc's free pages back to the kernel, so that memory an earlier case
    freed is not returned while this case runs (its inputs came out at -0 MiB under load)."""
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_memory_case(build: Callable[[], Callable[[], object]]) -> dict:
    """In the subprocess: build the inputs, run the case once (warm-up), reset the kernel's peak-RSS
    mark (``/proc/self/clear_refs``), run it again and report the peak resident set size reached
    above what the process held just before: ``peak_mib``; ``inputs_mib`` is the resident size of
    the inputs (RSS after building them minus before)."""
    _release_freed_memory()
    before_inputs = _status_mib("VmRSS")
    run = build()
    run()
    _release_freed_memory()
    resident = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    # The mark as reset is the baseline: RSS read before the reset can be a little higher (pages
    # released in between), which made an idle case's peak come out as -0 MiB.
    baseline = _status_mib("VmHWM")
    run()
    return {"inputs_mib": resident - before_inputs, "peak_mib": _status_mib("VmHWM") - baseline}
