"""The comparison report: training runs read back from verl's own tracking, turned into plots, CSV
tables and one self-contained HTML page with real segments and one SPO tree.

    python -m spo_workbench.report --run LABEL=METRICS_JSONL[,SAMPLES_JSONL] ... --output DIR [--title TITLE]

``METRICS_JSONL`` is what verl's ``file`` logger writes (``trainer.logger`` with ``file``, path in
``VERL_FILE_LOGGER_PATH``): one ``{"step": N, "data": {metric: value}}`` line per log call.
``SAMPLES_JSONL`` is the run's sample log (``algorithm.spo.diagnostics.sample_log.dir``/samples.jsonl).
"""
