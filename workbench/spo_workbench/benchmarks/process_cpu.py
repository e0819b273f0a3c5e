"""CPU seconds by process of a command and of everything it starts, two configurations side by side.

A shell's ``time`` misses most of a verl run: it counts a child's CPU only when that child waits for
its own children, and Ray's and vLLM's processes are ended, not waited for. Here the command's
descendants are read every second (``psutil``) and each one's last reading kept, grouped by its name
(``ray::WorkerDict``, ``VLLM::EngineCore``, ...); a process's last second can be missed. Each side is an environment assignment; rounds alternate (A B, B A, ...) so that a slow spell of
the machine hits both, and ``--copies`` runs that many copies of the command at once, each with its own
``EXPERIMENT_NAME``, as the test suite's end-to-end runs share two cores. What vLLM's waiting costs on
the CPU platform (``VLLM_PLUGINS=`` loads no vLLM plugin, so vLLM's readers spin as they do on a GPU)::

    python -m spo_workbench.benchmarks.process_cpu --csv docs/results/cpu_runs/vllm_wait.csv \\
        --side spin:VLLM_PLUGINS= --side sleep: --copies 2 --rounds 2 -- bash scripts/run_spo_tree.sh
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil


def process_name(process: psutil.Process) -> str:
    """Ray and vLLM name their processes (``ray::X``, ``VLLM::X``); others by program and module."""
    command = process.cmdline()
    if command and "::" in command[0]:
        return command[0].split()[0]
    if len(command) >= 3 and command[1] == "-m":
        return f"python -m {command[2]}"
    return Path(command[0]).name if command else process.name()


def run_round(command: list[str], environment: dict[str, str], copies: int, label: str,
              poll_seconds: float = 1.0) -> tuple[float, dict[str, float], list[int]]:
    """Run ``copies`` copies of ``command`` at once; returns the wall seconds until the last ended, CPU
    seconds by process name over the copies and every process they started (found among their
    descendants, then followed by pid, so one that outlives its parent still counts), and the return
    codes."""
    started = time.monotonic()
    running = [subprocess.Popen(command, env={**os.environ, **environment, "EXPERIMENT_NAME": f"{label}-copy{i}"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for i in range(copies)]
    followed: dict[int, psutil.Process] = {}
    seen: dict[int, tuple[str, float]] = {}
    while any(p.poll() is None for p in running):
        for copy in running:
            try:
                root = psutil.Process(copy.pid)
                for process in [root, *root.children(recursive=True)]:
                    followed.setdefault(process.pid, process)
            except psutil.NoSuchProcess:
                continue
        for pid, process in followed.items():
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    name = seen[pid][0] if pid in seen else process_name(process)
                    seen[pid] = (name, times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(poll_seconds)
    wall = time.monotonic() - started
    by_name: dict[str, float] = {}
    for name, seconds in seen.values():
        by_name[name] = by_name.get(name, 0.0) + seconds
    return wall, by_name, [p.returncode for p in running]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.benchmarks.process_cpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", action="append", required=True, metavar="NAME:VAR=VALUE,...",
                        help="a configuration: its name and the environment it sets (twice: A and B)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each side, alternating A B, B A")
    parser.add_argument("--copies", type=int, default=1, help="copies of the command run at once")
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if len(args.side) != 2 or not command:
        parser.error("give exactly two --side and a command after --")
    sides = []
    for side in args.side:
        name, _, assignments = side.partition(":")
        sides.append((name, dict(item.split("=", 1) for item in assignments.split(",") if item)))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    totals: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in sides}
    with open(args.csv, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["side", "environment", "round", "copies", "wall_seconds", "process", "cpu_seconds"])
        for round_index in range(args.rounds):
            for name, environment in (sides if round_index % 2 == 0 else sides[::-1]):
                wall, by_name, codes = run_round(command, environment, args.copies, f"cpu-{name}-{round_index}")
                if any(codes):
                    print(f"process_cpu: {name} round {round_index}: return codes {codes}", file=sys.stderr)
                    return 1
                described = " ".join(f"{k}={v}" for k, v in environment.items())
                for process, seconds in sorted(by_name.items(), key=lambda item: -item[1]):
                    writer.writerow([name, described, round_index, args.copies, f"{wall:.1f}", process, f"{seconds:.1f}"])
                handle.flush()
                totals[name].append((wall, sum(by_name.values())))
                print(f"process_cpu: {name} round {round_index}: {wall:.0f} s wall, {sum(by_name.values()):.0f} CPU s")
    (a, a_runs), (b, b_runs) = totals.items()
    for label, index in (("wall", 0), ("CPU", 1)):
        ratios = [x[index] / y[index] for x, y in zip(a_runs, b_runs)]
        print(f"process_cpu: {label} seconds, {a} / {b}: median {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
