"""DeepSpeed engine: the config dict from the typed config and the batch plan, and init."""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
from typing import Any

import torch

from elastic.config.schema import TrainConfig
from elastic.train import lazy_dynamo
from elastic.train.batch import BatchPlan

DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's reduce bucket by default (elements)
DEEPSPEED_PREFETCH = 50_000_000  # and ZeRO-3's prefetch bucket
BUCKETS_PER_MODEL = 8  # a reduce bucket holds 1/8 of the parameters, or the largest tensor
MIN_BUCKET = 1 << 20  # but not fewer elements (2 MB in bf16): small models, few reductions


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of CPUs with bf16 instructions: x86's AVX-512 BF16 and AMX, Arm's
BF16 extension ("bf16" in an aarch64 ``Features`` line)."""


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this machine's CPU has bf16 instructions; None where it cannot tell (no
    /proc/cpuinfo, as on macOS, or no flags in it). Without them PyTorch emulates bf16:
    a bf16 matrix product takes an order of magnitude longer than the fp32 one on an
    AVX2-only CPU."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & set(BF16_CPU_FLAGS)) if flags else None


def slow_bf16_warning(cfg: TrainConfig, cpuinfo: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """What the ``bf16_slow_on_cpu`` event says, where a run trains in bf16 on a CPU that
    lacks bf16 instructions (silently ~20x slower than fp32 there); None otherwise."""
    if cfg.strategy.precision != "bf16" or cfg.scaling.use_gpu:
        return None
    if cpu_has_bf16(cpuinfo) is not False:  # it has them, or no telling
        return None
    return {
        "missing": "/".join(BF16_CPU_FLAGS),
        "fix": "strategy.precision=fp32 (bf16 is emulated on this CPU: its matrix "
        "products ~20x slower than fp32)",
    }


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype the model's inputs are cast to (``strategy.precision``): what the
    engine computes in, in training and validation alike."""
    return torch.bfloat16 if cfg.strategy.precision == "bf16" else torch.float32


def bucket_sizes(model: torch.nn.Module, stage: int) -> dict[str, int]:
    """DeepSpeed's buffers sized from the model (elements). At stages 1-3 DeepSpeed
    allocates its gradient reduce bucket whole, 5e8 elements by default: 1 GB a rank in
    bf16 whatever the model, 16x a 12M-parameter ZeRO-3 rank's model states at 3 ranks.
    Here it holds 1/:data:`BUCKETS_PER_MODEL` of the parameters (the gradients then go
    in up to as many reductions a step), at least the largest tensor (a larger one goes
    alone) and :data:`MIN_BUCKET`, at most DeepSpeed's default; ZeRO-3's prefetch of
    parameters the same. (The all-gather bucket of stages 1-2 is left as it is: it
    allocates nothing ahead, and a smaller one only cuts the all-gather into more.)"""
    if stage == 0:  # plain data parallelism: DeepSpeed's all-reduce allocates per call
        return {}
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    total, largest = sum(numels), max(numels, default=1)
    size = min(DEEPSPEED_BUCKET, max(largest, MIN_BUCKET, -(-total // BUCKETS_PER_MODEL)))
    if stage < 3:
        return {"reduce_bucket_size": size}
    return {
        "reduce_bucket_size": size,
        "stage3_prefetch_bucket_size": min(DEEPSPEED_PREFETCH, size),
    }


def deepspeed_config(
    cfg: TrainConfig,
    plan: BatchPlan,
    load_universal: bool = False,
    model: torch.nn.Module | None = None,
) -> dict[str, Any]:
    """``model``: the buckets sized from it (:func:`bucket_sizes`), else DeepSpeed's."""
    s = cfg.strategy
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if model is not None:
        zero.update(bucket_sizes(model, s.zero_stage))
    ds: dict[str, Any] = {
        "train_batch_size": plan.deepspeed_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": s.precision == "bf16"},
        # we log ourselves; DeepSpeed's own periodic prints would interleave on every rank
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # client optimizers (torch) are what ZeRO then partitions; allow it explicitly
        "zero_allow_untested_optimizer": True,
        # always said: left out, DeepSpeed clips the gradient norm at 1.0 (its default),
        # where 0 here means no clipping
        "gradient_clipping": s.gradient_clipping,
    }
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds


def _optimizer(cfg: TrainConfig, params: Any, lr: float) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=o.weight_decay)
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    betas = (float(o.betas[0]), float(o.betas[1]))
    return cls(params, lr=lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of optim.lr after ``step`` optimizer steps (linear warmup, then schedule)."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "cosine":
        span = max(1, cfg.trainer.max_steps - o.warmup_steps)
        progress = min(1.0, (step - o.warmup_steps) / span)
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def _skip_shm_comm_op() -> None:
    """DeepSpeed JIT-compiles a shared-memory op for CPU all-reduce at init (27-57 s and
    ~2 GB of compiler memory on a fresh machine). Only its inference all-reduce uses it;
    training collectives go through torch.distributed (gloo), so we skip the build."""
    # not "import deepspeed.comm.torch as m": that reads the attribute ``torch`` of
    # deepspeed.comm, which is the torch package itself, so the patch would miss
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")
    if not hasattr(ds_torch, "build_shm_op"):
        raise RuntimeError("deepspeed.comm.torch.build_shm_op is gone: update _skip_shm_comm_op")
    ds_torch.build_shm_op = lambda: None


def warm_imports() -> threading.Thread:
    """Import, in the background, what building the engine would import on the spot:
    DeepSpeed and its Muon module (its optimizer check does;
    :func:`import_muon_uncompiled`), a second of CPU on a fresh worker, while the
    worker reads its checkpoint and starts its data pipeline. Join the thread before
    importing any of these yourself: two threads importing DeepSpeed's circular imports
    at once fail ("partially initialized module") or deadlock (both seen here)."""

    def run() -> None:
        try:
            import deepspeed  # noqa: F401

            import_muon_uncompiled()
        except Exception:  # only a head start: the real import reports any problem
            pass

    thread = threading.Thread(target=run, name="elastic-warm-imports", daemon=True)
    thread.start()
    return thread


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with its kernels left uncompiled.

    DeepSpeed's ZeRO checks every optimizer against its Muon class (each ZeRO 1-2 step,
    ZeRO 3 and bf16 at build), and that module ``torch.compile``s its kernels at import,
    which imports torch's inductor: seconds of CPU in every worker process of every
    worker group start. elastic builds only torch's SGD, Adam and AdamW
    (:func:`_optimizer`), so the class is only ever compared against, never run: it
    is imported as it is, its kernels plain functions. Idempotent; call it where no
    other thread imports DeepSpeed."""
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler

    compile_ = compiler.compile
    compiler.compile = lambda *args, **kwargs: lambda fn: fn  # @compiler.compile()
    try:
        from deepspeed.runtime.zero.muon import muon_optimizer  # noqa: F401
    finally:
        compiler.compile = compile_


def init_distributed(use_gpu: bool, warming: threading.Thread | None = None) -> None:
    lazy_dynamo.defer()  # before any optimizer: see elastic.train.lazy_dynamo
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if use_gpu else "cpu")
    if warming is not None:
        warming.join()  # never import DeepSpeed in two threads at once
    import deepspeed

    if not use_gpu:
        _skip_shm_comm_op()
    # Ray Train already created the process group; DeepSpeed wraps it.
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")


def build_engine(
    cfg: TrainConfig, plan: BatchPlan, model: torch.nn.Module, load_universal: bool = False
) -> Any:
    import deepspeed

    import_muon_uncompiled()
    optimizer = _optimizer(cfg, model.parameters(), cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, plan, load_universal, model),
    )
    return engine


def set_plan(engine: Any, plan: BatchPlan, rank: int) -> None:
    """A live run's quorum: the engine's batch settings for ``plan`` (its world size and
    gradient accumulation; DeepSpeed reads them from its config at each step) and this
    worker's ``rank`` in it (whose checkpoint files it writes)."""
    c = engine._config
    c.train_batch_size = plan.deepspeed_batch_size
    c.train_micro_batch_size_per_gpu = plan.micro_batch_size
    c.gradient_accumulation_steps = plan.grad_accum_steps
    engine.dp_world_size = engine.world_size = plan.world_size
    engine.global_rank = rank
    # which rank writes the model's checkpoint file: set when the engine was built, in
    # another group (a newcomer's alone) or at another rank (the eldest gone)
    engine.save_non_zero_checkpoint = engine.checkpoint_engine.is_data_parallel_writer(rank)


def set_base_lr(engine: Any, cfg: TrainConfig) -> None:
    """After a restore: the learning rate follows the config of this start
    (``optim.lr``), not the one saved in the checkpoint."""
    lr = cfg.optim.lr
    scheduler = engine.lr_scheduler
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["initial_lr"] = lr
        group["lr"] = lr * factor
