"""elastic: Ray-based elastic distributed trainer."""
