"""Test and benchmark helpers for spo-verl: verl's own vLLM server replica on CPU (``verl_server``),
verl's FSDP engine in one process (``verl_engine``), verl configs and agent-loop sessions
(``verl_harness``) and random SPO trees (``random_trees``). The run settings do not import them."""
