"""verl's FSDP engine switched to packed forwards (``engine``), each prompt's rows kept together under the
token budget (``micro_batches``); the packing itself is the core's (:mod:`spo_verl.core.packing`)."""
