"""The model families' networks (torch modules), one module a family that needs more
than a few layers. A family's config (``elastic/models/<family>.py``) imports its network
only in ``build()``: every command reads the configs (composition, the one-line config
errors, a read task's decoder), and none of that should wait for torch."""
