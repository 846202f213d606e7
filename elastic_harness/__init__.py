"""Beside the product, not in it: a multi-node Ray cluster on one machine and the run
harness the tests and the benchmarks drive (:mod:`elastic_harness.localcluster`).
``elastic`` never imports it (tests/test_imports.py checks)."""
