"""Data preparation for SPO experiments (verl parquet files)."""
