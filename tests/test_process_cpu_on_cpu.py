"""CPU seconds by process, side by side: every process the command starts is counted by its name, each
side's environment reaches the command, copies run at once and rounds alternate."""

import csv
import sys

from spo_workbench.benchmarks import process_cpu

# Burns WORK x 0.4 CPU seconds in a child process named by its module-less command, then idles long
# enough for the last reading to see all of it.
CHILD = ("import os, time\n"
         "goal = 0.4 * float(os.environ['WORK'])\n"
         "while time.process_time() < goal: pass\n"
         "time.sleep(1.5)\n")
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}], check=True)"


def test_each_side_counts_the_cpu_of_every_process_it_started(tmp_path, capsys):
    out = tmp_path / "cpu.csv"
    assert process_cpu.main(["--csv", str(out), "--side", "light:WORK=1", "--side", "heavy:WORK=2",
                             "--copies", "2", "--rounds", "2", "--", sys.executable, "-c", PARENT]) == 0
    with open(out, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["round"], r["side"]) for r in rows if float(r["cpu_seconds"]) >= 0.5] == [
        ("0", "light"), ("0", "heavy"), ("1", "heavy"), ("1", "light")]  # A B, then B A
    for row in rows:
        assert row["copies"] == "2" and row["environment"] == ("WORK=1" if row["side"] == "light" else "WORK=2")
    burned = {(r["side"], r["round"]): float(r["cpu_seconds"]) for r in rows if float(r["cpu_seconds"]) >= 0.5}
    # Two copies' children each: 2 x 0.4 s on the light side, 2 x 0.8 s on the heavy one (a reading a
    # second apart can miss at most the parent's start-up, never the child's burn).
    for (side, _), seconds in burned.items():
        assert (0.75 <= seconds <= 1.3) if side == "light" else (1.55 <= seconds <= 2.1), (side, seconds)
    assert "CPU seconds, light / heavy: median" in capsys.readouterr().out
