"""What is built on the plugin: the study, its report, the credit command, the benchmarks, the CPU
settings and data, the launcher's checks and the test harness."""
