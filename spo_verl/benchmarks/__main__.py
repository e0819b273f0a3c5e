from spo_verl.benchmarks.cli import main

main()
