"""SPO in verl: its registration (``registration``), the registered estimators and loss, the rewards, agent
loops, trainers, the packed FSDP engine and the CPU platform. They import verl and the core, nothing of the
recipe or the workbench."""
