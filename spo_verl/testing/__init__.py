"""Test helpers for spo-verl (tiny local models, a CPU vLLM server wrapper)."""
