"""The ZeRO-0 gradient all-reduce, elastic's own: overlapped with the backward pass.

DeepSpeed at ZeRO-0 (fp32) reduces after the whole backward pass: it flattens every
gradient into a new buffer, all-reduces it, scales it by 1/world and copies it back,
three memory passes over the gradients that nothing overlaps (9-12% of a smoke-model
step on 2 cores in a profile: docs/performance.md#step-overhead). Here each gradient
goes, as soon as autograd has accumulated it, into its slot of a flat bucket, scaled on
the way (one pass, while it is still in cache), ``param.grad`` becomes a view of that
slot, and a bucket's all-reduce starts as soon as its last gradient is in: in a fixed
bucket order on every rank, so the collectives pair up whatever order the gradients
come in.
:meth:`OverlappedReduce.finish` waits for them before the optimizer step. Buckets as
torch's DDP: parameters in reverse order (roughly the order backward produces them),
1 MiB for the first bucket, 25 MiB for the others.

The result is DeepSpeed's up to fp32 rounding (here each gradient is scaled before the
sum, there the sum after it): the gradients averaged over the ranks, accumulated over
the micro-steps of a step (reduced at its last only), a parameter that got no gradient
reduced as zeros. Only for fp32 ZeRO-0, where the optimizer is the torch one and reads
``param.grad``; bf16 (DeepSpeed's own fp32 gradient buffers), ZeRO 1-3 (partitioned
reductions), mixture-of-experts layers (reduced over their expert groups) and sparse
embeddings stay with DeepSpeed (:func:`overlapped_reduce` returns None). Refused in one
line, with the setting that avoids it: a parameter that takes two gradients in one
backward pass (reentrant activation checkpointing), a sparse gradient from elsewhere,
a parameter frozen or unfrozen during the run. Memory: the buckets hold the gradients
between steps (4 bytes a parameter, as torch DDP's do), where DeepSpeed frees them
after the optimizer step and flattens them into a second buffer during its reduction.

On by default (``strategy.overlap_reduce``; false for DeepSpeed's) because it was
measured faster than DeepSpeed's reduction on the same runs (``python launch/bench.py
overhead --zero-stages 0 --variant 'deepspeed=strategy.overlap_reduce=false'``; the
figures: docs/performance.md#step-overhead). Where the all-reduce crosses a network,
more of it can hide behind the backward pass; that is not measured yet. Not run on a
GPU yet (NCCL: the hooks run on the backward pass's stream,
the collectives wait for it)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from elastic.config.schema import StrategyConfig
from elastic.train.timing import CollectiveClock

FIRST_BUCKET_BYTES = 1 << 20  # torch DDP's: the first all-reduce starts early
BUCKET_BYTES = 25 << 20  # and its bucket_cap_mb for the rest


def overlapped_reduce(
    engine: Any, strategy: StrategyConfig, live: bool = False
) -> OverlappedReduce | None:
    """Take the gradient reduction over from ``engine`` where asked
    (``strategy.overlap_reduce``, the default) and where this module can (fp32 ZeRO-0, a plain torch
    optimizer); None, and DeepSpeed's left in place, otherwise. ``live``: a live run's
    (its quorum may shrink to one worker and grow again: kept at any size)."""
    if not strategy.overlap_reduce or strategy.zero_stage != 0 or strategy.precision != "fp32":
        return None
    if type(engine.optimizer).__module__.split(".")[0] == "deepspeed":
        return None  # one of DeepSpeed's optimizer wrappers: it keeps its own gradients
    if getattr(engine, "has_moe_layers", False):
        return None  # experts reduce over their expert group, not the world: DeepSpeed's
    if any(getattr(m, "sparse", False) is True for m in engine.module.modules()):
        return None  # a sparse embedding's gradients: DeepSpeed reduces them as such
    if not dist.is_initialized() or (dist.get_world_size() == 1 and not live):
        return None
    return OverlappedReduce(engine)


class OverlappedReduce:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.world = dist.get_world_size()
        # the whole step in one micro-step: a gradient is scaled as it is copied
        self.fused = engine.gradient_accumulation_steps() == 1
        self.all_params = list(engine.module.parameters())
        self.trainable = [p.requires_grad for p in self.all_params]
        params = [p for p in self.all_params if p.requires_grad]
        self.buckets: list[torch.Tensor] = []
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        self.bucket_of: dict[torch.Tensor, int] = {}
        self.members: list[list[torch.Tensor]] = []
        for group in _bucketed(list(reversed(params))):
            flat = torch.zeros(
                sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device
            )
            offset = 0
            for p in group:
                self.views[p] = flat[offset : offset + p.numel()].view_as(p)
                self.bucket_of[p] = len(self.buckets)
                offset += p.numel()
            self.buckets.append(flat)
            self.members.append(group)
        self._new_step()
        for p in params:
            p.register_post_accumulate_grad_hook(self._accumulated)
        engine.enable_backward_allreduce = False  # DeepSpeed's own pass: now this one

    def regroup(self, world: int) -> None:
        """A live run's new quorum (``world`` workers), the step in flight not
        committed: its gradients are dropped, the step starts over."""
        self.world = world
        self.fused = self.engine.gradient_accumulation_steps() == 1
        for p, view in self.views.items():
            view.zero_()
            p.grad = None
        self._new_step()

    def _new_step(self) -> None:
        self.seen: set[torch.Tensor] = set()  # parameters with a gradient this step
        self._ready = [0] * len(self.buckets)  # of each bucket, in this micro-step
        self._counted: set[torch.Tensor] = set()  # the parameters _ready counts
        self._launched: list[Any] = []  # the all-reduces started, in bucket order

    def _accumulated(self, p: torch.Tensor) -> None:
        """Autograd's hook, after ``p.grad`` took this micro-step's gradient."""
        view = self.views[p]
        grad = p.grad
        assert grad is not None  # autograd calls this hook after accumulating it
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"elastic.train.reduce: a {grad.layout} gradient (shape "
                f"{tuple(p.shape)}) cannot go into the overlapped all-reduce's dense "
                "buckets; set strategy.overlap_reduce=false"
            )
        if grad.data_ptr() != view.data_ptr():  # fresh: the first micro-step it had one
            if p in self.seen:
                raise RuntimeError(
                    "elastic.train.reduce: a parameter's gradient was replaced between "
                    "micro-steps of one step; the overlapped reduction cannot sum it"
                )
            if self.fused:
                torch.mul(grad, 1.0 / self.world, out=view)
            else:
                view.copy_(grad)
            p.grad = view
        elif p not in self.seen:
            raise RuntimeError(
                "elastic.train.reduce: a gradient from the last step was not cleared "
                "(the engine did not zero the gradients after its optimizer step)"
            )
        self.seen.add(p)
        if self.engine.is_gradient_accumulation_boundary():
            if p in self._counted:  # its bucket may be on the wire already
                raise RuntimeError(
                    "elastic.train.reduce: a parameter took two gradients in one backward "
                    "pass (reentrant activation checkpointing?); set "
                    "strategy.overlap_reduce=false"
                )
            self._counted.add(p)
            b = self.bucket_of[p]
            self._ready[b] += 1
            while len(self._launched) < len(self.buckets):
                nxt = len(self._launched)
                if self._ready[nxt] < len(self.members[nxt]):
                    break
                self._launch(nxt)

    def _launch(self, b: int) -> None:
        if not self.fused:
            self.buckets[b].mul_(1.0 / self.world)
        self._launched.append(dist.all_reduce(self.buckets[b], async_op=True))

    def finish(self) -> None:
        """After ``engine.backward``: at a step's last micro-step, start what has not
        started (a parameter with no gradient goes in as zeros) and wait for all of it."""
        if not self.engine.is_gradient_accumulation_boundary():
            return
        if [p.requires_grad for p in self.all_params] != self.trainable:
            # the buckets are the parameters trainable when the run began: one frozen
            # or unfrozen since would be reduced wrongly or not at all, without a word
            raise RuntimeError(
                "elastic.train.reduce: a parameter's requires_grad changed during the "
                "run; the overlapped all-reduce keeps the trainable parameters of the "
                "start: set strategy.overlap_reduce=false to freeze or unfreeze layers"
            )
        for p, view in self.views.items():
            if p not in self.seen:
                view.zero_()
                p.grad = view
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        t0 = time.perf_counter()
        for work in self._launched:
            work.wait()
        CollectiveClock.waited(time.perf_counter() - t0)
        self._new_step()


def _bucketed(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, up to a bucket's bytes each (a
    larger tensor alone)."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        cap = FIRST_BUCKET_BYTES if len(groups) <= 1 else BUCKET_BYTES
        nbytes = p.numel() * p.element_size()
        fits = groups and size + nbytes <= cap
        same = groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device)
        if fits and same:
            groups[-1].append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups
