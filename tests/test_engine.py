"""Worker start-up around DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_cpu_shared_memory_op_is_never_built():
    """DeepSpeed would JIT-build (or load under a file lock) its shared-memory op on
    every CPU init; a process killed while holding that lock stalls every later run
    forever. The skip must reach the module TorchBackend calls it from."""
    code = (
        "import sys\n"
        "from elastic.train.engine import _skip_shm_comm_op, warm_imports\n"
        "warm_imports().join()\n"
        "_skip_shm_comm_op()\n"
        "m = sys.modules['deepspeed.comm.torch']\n"
        "assert m.TorchBackend.__init__.__globals__['build_shm_op']() is None\n"
        "print('skipped')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0 and "skipped" in out.stdout, out.stderr[-2000:]
