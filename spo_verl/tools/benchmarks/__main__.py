from spo_verl.tools.benchmarks.cli import main

main()
