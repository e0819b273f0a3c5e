"""Benchmarks users can trust: SPO against what users would otherwise run (verl's ``grpo`` and
``vanilla``, independent sampling), at cluster sizes where no model is needed and through verl's real
rollout path on the CPU, each comparison run side by side in one run. One command regenerates
``docs/BENCHMARKS.md``:

    bash scripts/benchmark.sh [--quick] [--skip-rollout] [--output docs/BENCHMARKS.md]

Modules: ``maths`` (estimators, batched functions, loss), ``rollout`` (trees and SPO-chain through
verl's agent-loop worker and vLLM server), ``tokens`` (training tokens per step), ``timing``
(alternating comparisons, peak memory), ``report`` (the Markdown), ``cli`` (the command).
``gpu_check`` is the prepared GPU check (``bash scripts/gpu_check.sh``, docs/CLUSTER.md; no verl), with
``gpu_model``, ``gpu_packing``, ``gpu_maths`` and ``gpu_report``.
"""
