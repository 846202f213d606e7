"""Training: the driver (Ray Train ``fit``), the per-worker loop, the DeepSpeed engine,
the batch plan, checkpoints, exactly-once accounting and the run's control actor."""
