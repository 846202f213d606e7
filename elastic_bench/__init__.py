"""Benchmarks, each measured side by side with its peer in one run and reported as a ratio
beside its target: one module per benchmark (``overhead``, ``ingest``, ``recovery``,
``chaos``, ``memory``, ``gpu``, ``hetero``, ``startup``; ``scale``, a package of its
own), each with its target(s) as module constants and its own command-line flags;
``common`` what they share (a run through ``launch/run.py``, a peer under
``torchrun``); ``table`` the ``bench all`` run and its table. The command line is
``launch/bench.py``."""
