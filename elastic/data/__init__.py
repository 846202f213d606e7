"""Data: Parquet shards and their checks, the Ray Data pipeline, worker-side streaming,
and the registry of data formats."""
