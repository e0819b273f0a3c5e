"""The learning studies: the runs (``compare``, ``scripts/compare.sh``), their table (``table``), the
verdict at a token budget (``verdict``) and the base model's calibration on a task (``calibration``)."""
