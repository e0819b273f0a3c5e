"""Adapters on verl's two trainers (``v1``, ``legacy``) and their task runners (``runners``): SPO
metadata to the estimators, SPO's actor loss, packed training (``packed_worker``, ``tree_balance``),
the sample log, credit metrics and generated-token budget, and the checks a run's configuration gets
before Ray starts (``validation``)."""
