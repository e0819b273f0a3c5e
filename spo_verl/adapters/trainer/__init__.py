"""Adapters on verl's two trainers (``v1``, ``legacy``) and their task runners (``runners``): SPO's step
on a training batch, one call for both (``step``: SPO metadata to the estimators, the sample log, credit
metrics and generated-token budget), SPO's actor loss, packed training (``packed_worker``,
``tree_balance``), validation with plain answers (``plain_validation``), and the checks a run's
configuration gets before Ray starts (``validation``)."""
