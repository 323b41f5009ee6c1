"""Benchmark support: machine and commit description, tables, results files."""
