"""The benchmarks: `python bench/suite.py` (or `python -m bench`) runs the comparisons a user weighs
ntp_nemo by and writes docs/benchmarks.md's table; each `bench/NAME.py` also runs on its own
(`python bench/NAME.py`, `python -m bench.NAME`) and is importable (`import bench.NAME`) by the tests."""
