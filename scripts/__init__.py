"""Benchmarks and one-off runs (`bench_*.py` print a table and write JSON); none of them is
imported by the package."""
