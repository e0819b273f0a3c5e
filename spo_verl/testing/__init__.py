"""Test, demo and benchmark helpers for spo-verl: tiny local models, stand-ins for verl's GPU pipeline,
verl's own vLLM server replica on CPU (``verl_server``, used by the tests and the benchmark) and a light
CPU vLLM engine for the CPU demo (``tiny_vllm``)."""
