"""The README's CPU demo command runs on this machine: SPO-tree end to end with a real vLLM engine."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cpu_demo_runs_on_policy_iterations_and_writes_the_segment_view(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "cpu_demo.sh"), "--steps", "2", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "iteration 0" in out and "iteration 1" in out
    # After the update the engine reloads the weights: its log-probs still match the actor's.
    gaps = [float(g) for g in re.findall(r"max \|rollout - actor log-prob\|\s+(\S+)", out)]
    assert len(gaps) == 2 and max(gaps) < 1e-4
    losses = [float(v) for v in re.findall(r"^\s+loss\s+(\S+)$", out, flags=re.MULTILINE)]
    assert len(losses) == 2 and all(abs(v) < 10 for v in losses)
    nodes = [float(v) for v in re.findall(r"tree/nodes_per_tree\s+(\S+)", out)]
    assert all(3 <= n <= 12 for n in nodes)  # branching 3,3: 3 first segments, at most 9 more
    page = (tmp_path / "segments.html").read_text()
    assert page.count("class='seg'") >= 3 and "reward" in page

