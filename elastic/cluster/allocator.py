"""A training worker's large buffers kept for reuse instead of mapped afresh every step.

DeepSpeed's ZeRO 1-3 allocate and free buffers of about the model's size every step (the
flat gradients, the all-gathered parameters). glibc's malloc serves such blocks with
``mmap`` and gives them back (``munmap``, or trimming its heaps), so the next step maps
them again and takes a page fault on every 4 KiB page of first touch, which the kernel
zeroes: 4,600-8,700 faults a step for a 4.7M-parameter model at ZeRO-2 (one to two
fp32 copies of it; ``getrusage``). Ray Train runs the training function in a thread of
its own, whose allocations go to a separate malloc arena, and those arenas' heaps are
given back when they empty whatever the thresholds say; so the thresholds alone do not
do it there (8,700 faults a step): one arena for every thread, the largest mmap
threshold (32 MiB on 64-bit glibc) and a high trim threshold do (no fault a step).
Set as environment variables of every Ray worker elastic starts (glibc reads them when
a process starts). At ZeRO-0 too: autograd allocates every gradient afresh each step
(the optimizer sets them to None), the largest of the smoke model 16 MiB: plain DDP under
torchrun is faster with these settings too (``bench.py overhead`` runs that peer beside
plain DDP at ZeRO-0: docs/performance.md#step-overhead).

The cost: memory a worker frees is kept, up to :data:`TRIM_THRESHOLD` beyond what it
holds; one arena serialises the threads' mallocs of blocks too large for their caches.
A user who sets any of glibc's malloc variables (``MALLOC_*``, ``GLIBC_TUNABLES``) keeps
theirs: then nothing here is set.
"""

from __future__ import annotations

from collections.abc import Mapping

MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}


def worker_malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables for the workers' environment: :data:`MALLOC_ENV`, or none when
    ``environ`` (the driver's) already sets any of glibc's malloc variables."""
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in environ):
        return {}
    return dict(MALLOC_ENV)
