from spo_workbench.benchmarks.cli import main

main()
