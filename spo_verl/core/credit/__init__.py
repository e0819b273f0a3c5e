"""Where each estimator puts the blame of a wrong answer (``blame``), each step's summary of it for the
trainer's metrics (``online``) and the step checker of the CPU tasks' answers (``answer_errors``)."""
