"""The engine-level tests' rank processes (tests/ranks.py) start with what a rank
imports already imported, from the same elastic as this process: a fork server whose
preload failed to import would go on without a word, and those tests would take ~10x
as long."""

from __future__ import annotations

import json
import sys

from ranks import start_ranks

import elastic

PRELOADED = (
    "torch._dynamo",  # the stand-in (elastic.train.lazy_dynamo), as in a worker
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "elastic.train.checkpoint",
    "elastic.train.engine",
)


def _imported(rank: int, out: str) -> None:
    with open(out, "w") as f:
        loaded = {name: name in sys.modules for name in PRELOADED}
        json.dump({"loaded": loaded, "elastic": sys.modules["elastic"].__file__}, f)


def test_a_rank_starts_with_torch_and_deepspeed_imported_as_a_worker_does(tmp_path):
    out = tmp_path / "imported.json"
    start_ranks(_imported, (str(out),), 1)
    got = json.loads(out.read_text())
    assert got["loaded"] == dict.fromkeys(PRELOADED, True)
    assert got["elastic"] == elastic.__file__  # the library under test, not another copy
