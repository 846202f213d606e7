"""Observing runs: the run's records (metrics.jsonl), W&B tracking, the driver's
progress display, reports."""
