"""Test and demo helpers for spo-verl: tiny local models, stand-ins for verl's GPU pipeline and a
light CPU vLLM engine for the CPU demo and the benchmark (the tests use verl's own vLLM server on CPU,
``tests/verl_server.py``)."""
