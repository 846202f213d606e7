"""The engine-level tests' rank processes (tests/ranks.py) start with what a rank
imports already imported: a fork server whose preload failed to import would go on
without a word, and those tests would take ~10x as long."""

from __future__ import annotations

import json
import sys

from ranks import start_ranks

PRELOADED = ("torch", "torch._dynamo", "deepspeed", "elastic.train.engine")


def _imported(rank: int, out: str) -> None:
    with open(out, "w") as f:
        json.dump({name: name in sys.modules for name in PRELOADED}, f)


def test_a_rank_starts_with_torch_deepspeed_and_the_compiler_stack_imported(tmp_path):
    out = tmp_path / "imported.json"
    start_ranks(_imported, (str(out),), 1)
    assert json.loads(out.read_text()) == dict.fromkeys(PRELOADED, True)
