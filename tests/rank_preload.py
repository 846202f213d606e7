"""What every rank of tests/ranks.py imports, imported once, in its fork server."""

import os

# DeepSpeed picks its accelerator at import, once: the ranks run on CPU whatever this
# environment says (each sets DS_ACCELERATOR=cpu too, which would come too late)
os.environ["DS_ACCELERATOR"] = "cpu"

import deepspeed  # noqa: E402,F401
import torch  # noqa: E402,F401

import elastic.train.checkpoint  # noqa: E402,F401
from elastic.train import lazy_dynamo  # noqa: E402
from elastic.train.engine import import_muon_uncompiled  # noqa: E402

# as a worker starts: torch's compiler front end stood in for (its import is seconds;
# nothing here compiles), and DeepSpeed's Muon module, which its ZeRO optimizer check
# imports on the spot, imported without compiling its kernels
lazy_dynamo.defer()
import_muon_uncompiled()
