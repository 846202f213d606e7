"""``ray start`` as the batch bootstrap runs it on every node (``python -m
elastic.cluster.ray_start start ...``): Ray's own command line, its arguments unchanged,
with the node's Python workers started by :mod:`elastic.cluster.worker_exec`
(:func:`~elastic.cluster.ray_internals.fast_worker_start`)."""

from __future__ import annotations

import sys

from elastic.cluster.ray_internals import fast_worker_start

if __name__ == "__main__":
    from ray.scripts.scripts import main

    fast_worker_start()
    sys.argv[0] = "ray"
    sys.exit(main())
