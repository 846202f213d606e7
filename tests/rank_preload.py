"""What every rank of tests/ranks.py imports, imported once, in its fork server."""

import os

# DeepSpeed picks its accelerator at import, once: the ranks run on CPU whatever this
# environment says (each sets DS_ACCELERATOR=cpu too, which would come too late)
os.environ["DS_ACCELERATOR"] = "cpu"

import deepspeed  # noqa: E402,F401
import torch  # noqa: E402,F401

# what building an engine imports on the spot: torch's compiler stack (a torch
# optimizer's constructor imports it) and DeepSpeed's Muon module (its ZeRO optimizer
# check does), as a worker imports it: without compiling its kernels
import torch._dynamo  # noqa: E402,F401

import elastic.train.checkpoint  # noqa: E402,F401
from elastic.train.engine import import_muon_uncompiled  # noqa: E402

import_muon_uncompiled()
