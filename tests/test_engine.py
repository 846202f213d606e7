"""Worker start-up around DeepSpeed, and the engine elastic builds: it does the update
the config asks for, checked against plain torch computing the same steps on its own (no
DeepSpeed, one process, the whole global batch), at every ZeRO stage, with
``strategy.gradient_clipping`` off (0: DeepSpeed's own default would clip at 1.0) and on."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from ranks import free_port, spawn_ranks, start_ranks


def test_the_cpu_shared_memory_op_is_never_built_nor_muons_kernels_compiled():
    """DeepSpeed would JIT-build (or load under a file lock) its shared-memory op on
    every CPU init; a process killed while holding that lock stalls every later run
    forever. The skip must reach the module TorchBackend calls it from. And a worker's
    start imports DeepSpeed's Muon optimizer (ZeRO compares every optimizer against it)
    without compiling its kernels (torch's inductor, seconds a worker process), and
    leaves DeepSpeed's compile() as it was."""
    code = (
        "import sys, torch\n"
        "from elastic.train.engine import _skip_shm_comm_op, warm_imports\n"
        "warm_imports().join()\n"
        "_skip_shm_comm_op()\n"
        "m = sys.modules['deepspeed.comm.torch']\n"
        "assert m.TorchBackend.__init__.__globals__['build_shm_op']() is None\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "from deepspeed.runtime.zero.muon.original_muon import muon_update\n"
        "from deepspeed.runtime import compiler\n"
        "assert isinstance(MuonWithAuxAdam, type) and callable(muon_update)\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "assert compiler.compile() is torch.compile\n"
        "print('skipped')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0 and "skipped" in out.stdout, out.stderr[-2000:]


_NO_COMPILER = """
import dataclasses, os, sys, tempfile, torch
import torch.distributed as dist
from elastic.train import lazy_dynamo
lazy_dynamo.defer()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
from elastic.config.schema import OptimConfig
from elastic.train.batch import BatchPlan
from elastic.train.engine import build_engine, init_distributed
from test_engine import _cfg
init_distributed(False)
x, y = torch.randn(8, 8), torch.randn(8, 3)
for stage, bf16 in ((0, False), (1, False), (2, False), (3, False), (3, True)):
    cfg = _cfg(stage, 0.5)
    if bf16:  # and AdamW, as the ViT experiment trains
        strategy = dataclasses.replace(cfg.strategy, precision="bf16")
        cfg = dataclasses.replace(cfg, strategy=strategy, optim=OptimConfig(name="adamw"))
    engine = build_engine(cfg, BatchPlan.for_world(8, 1), cfg.model.build())
    dtype = next(engine.module.parameters()).dtype
    for _ in range(2):
        engine.backward(((engine(x.to(dtype)).float() - y) ** 2).mean())
        engine.step()
    d = tempfile.mkdtemp()
    engine.save_checkpoint(d, tag="t")
    engine.load_checkpoint(d, tag="t")
    assert not lazy_dynamo.loaded(), f"ZeRO {stage} (bf16 {bf16}) loaded torch._dynamo"
seen = []
def h(t):
    seen.append(torch.compiler.is_compiling())
    return t + 1
g = torch.compiler.disable(h)  # disabled before the real module is loaded
# a submodule's import as the first touch: the real package, each module once
import torch._dynamo.config as config
from torch._dynamo import eval_frame
assert lazy_dynamo.loaded() and eval_frame.config is config
assert torch._dynamo is sys.modules["torch._dynamo"] and type(torch._dynamo) is type(torch)
f = torch.compile(lambda t: g(t) * 2, backend="eager")
t = torch.arange(3.0)
assert torch.equal(f(t), (t + 1) * 2) and torch.equal(f(t), (t + 1) * 2)
assert seen == [False, False], seen  # run eagerly, not traced into the graph
print("eager, then compiled")
"""

_DISABLED_MODULE = """
import torch
from elastic.train import lazy_dynamo
lazy_dynamo.defer()
m = torch.compiler.disable(torch.nn.Linear(2, 2))  # what dynamo makes of a module
assert isinstance(m, torch.nn.Module) and len(list(m.parameters())) == 2, type(m)
print("a module")
"""


def test_a_worker_never_imports_torchs_compiler_and_torch_compile_still_works():
    """``elastic.train.lazy_dynamo``: DeepSpeed at every ZeRO stage (and bf16 with
    AdamW), with clipping, a checkpoint saved and restored, never loads the real
    ``torch._dynamo`` (~2 CPU s a worker start); a submodule's import then loads it
    with each module once, ``torch.compile`` compiles and still runs a function
    disabled before the load eagerly; ``disable`` of a module is dynamo's."""
    for code, said in ((_NO_COMPILER, "eager, then compiled"), (_DISABLED_MODULE, "a module")):
        out = subprocess.run(
            [sys.executable, "-c", code, str(free_port())],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(__file__),
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
        assert out.returncode == 0 and said in out.stdout, out.stderr[-3000:]


STAGES = (0, 1, 2, 3)
CLIPS = (0.0, 0.5)
LR = 0.01
STEPS = 2
GLOBAL = 8


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # targets far from the outputs: the gradient norm is far above 1 and above 0.5
    return torch.randn(GLOBAL, 8, generator=g), 50 * torch.randn(GLOBAL, 3, generator=g)


def _cfg(stage: int, clip: float):
    from elastic.config.schema import DataConfig, OptimConfig, StrategyConfig, TrainConfig
    from elastic.models.mlp import MLPConfig

    return TrainConfig(
        model=MLPConfig(input_dim=8, hidden_dims=[16], output_dim=3),
        data=DataConfig(path="unused", global_batch_size=GLOBAL),
        strategy=StrategyConfig(zero_stage=stage, gradient_clipping=clip),
        optim=OptimConfig(name="sgd", lr=LR),
    )


def _reference(clip: float) -> list[list[float]]:
    """Plain torch: the mean loss over the global batch, clipped as asked, SGD with
    momentum 0.9 (elastic's ``optim.name=sgd``)."""
    torch.manual_seed(0)
    model = _cfg(0, clip).model.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _batch()
    for _ in range(STEPS):
        opt.zero_grad()
        ((model(x) - y) ** 2).sum(1).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _join_two_ranks(rank: int, port: int) -> None:
    """This process as ``rank`` of a 2-rank gloo group, DeepSpeed on it."""
    import torch.distributed as dist

    from elastic.train.engine import init_distributed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    init_distributed(False)


def _rank(rank: int, port: int, out: str) -> None:
    _join_two_ranks(rank, port)
    import deepspeed
    import torch.distributed as dist

    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine

    x, y = _batch()
    mine = slice(rank * GLOBAL // 2, (rank + 1) * GLOBAL // 2)
    results = {}
    for stage in STAGES:
        for clip in CLIPS:
            cfg = _cfg(stage, clip)
            torch.manual_seed(0)
            engine = build_engine(cfg, BatchPlan.for_world(GLOBAL, 2), cfg.model.build())
            for _ in range(STEPS):
                # the loop's weighting: each rank's loss sum x world / global rows
                loss = ((engine(x[mine]) - y[mine]) ** 2).sum() * 2 / GLOBAL
                engine.backward(loss)
                engine.step()
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
                results[f"{stage}/{clip}"] = [p.detach().flatten().tolist() for p in params]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no gloo/DeepSpeed thread left to abort the interpreter's teardown


def test_every_stage_updates_as_plain_torch_does_with_clipping_off_and_on(tmp_path):
    out = str(tmp_path / "params.json")
    start_ranks(_rank, (free_port(), out), 2)
    with open(out) as f:
        got = json.load(f)
    for clip in CLIPS:
        want = [torch.tensor(p) for p in _reference(clip)]
        unclipped = [torch.tensor(p) for p in _reference(0.0)]
        for stage in STAGES:
            params = [torch.tensor(p) for p in got[f"{stage}/{clip}"]]
            worst = max((a - b).abs().max().item() for a, b in zip(params, want, strict=True))
            assert worst < 1e-5, (stage, clip, worst)
        if clip:  # the case tells clipped from unclipped apart
            gap = max((a - b).abs().max().item() for a, b in zip(want, unclipped, strict=True))
            assert gap > 1e-3, gap


def _faults_rank(rank: int, port: int, out: str) -> None:
    """Minor page faults of each ZeRO-2 step after 5 to warm up, in this process."""
    import resource

    _join_two_ranks(rank, port)
    import torch.distributed as dist

    from elastic.config.schema import DataConfig, StrategyConfig, TrainConfig
    from elastic.models.mlp import MLPConfig
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine

    cfg = TrainConfig(  # the smoke model: 4.7M parameters
        model=MLPConfig(input_dim=256, hidden_dims=[2048, 2048], output_dim=16),
        data=DataConfig(path="unused", global_batch_size=16),
        strategy=StrategyConfig(zero_stage=2),
    )
    torch.manual_seed(0)
    engine = build_engine(cfg, BatchPlan.for_world(16, 2), cfg.model.build())
    x, y = torch.randn(8, 256), torch.randn(8, 16)
    faults = []
    for _ in range(15):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.backward(((engine(x) - y) ** 2).sum())
        engine.step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(faults[5:], f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_zero2_steps_map_no_fresh_pages_with_the_workers_malloc_settings(tmp_path, monkeypatch):
    """With glibc's defaults DeepSpeed's per-step buffers are mapped afresh every step
    (thousands of page faults a step: the control, so that the check can fail); with
    the environment elastic gives its Ray workers, the steps reuse them. (Here on the
    main thread; in Ray Train's training thread the defaults fault as much or more:
    docs/performance.md#step-overhead has a run's workers measured.)"""
    from elastic.cluster.allocator import MALLOC_ENV, worker_malloc_env

    for key in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key)
    assert worker_malloc_env(os.environ) == MALLOC_ENV
    assert worker_malloc_env({"MALLOC_ARENA_MAX": "4"}) == {}  # the user's own: kept

    def faults(kept: bool) -> list[int]:
        for key, value in MALLOC_ENV.items():  # the spawned ranks inherit os.environ
            if kept:
                monkeypatch.setenv(key, value)
        out = str(tmp_path / f"{kept}.json")
        spawn_ranks(_faults_rank, (free_port(), out), 2)  # a fresh glibc, this environment
        with open(out) as f:
            return json.load(f)

    # glibc's own mmap threshold moves with what was freed before: about one run in six
    # here its defaults happened to keep the buffers too (0 faults), and the control
    # could not tell the settings apart; up to 3 tries for a control that faults
    tries = [faults(kept=False)]
    while statistics.median(tries[-1]) <= 1000 and len(tries) < 3:
        tries.append(faults(kept=False))
    fresh, kept_faults = tries[-1], faults(kept=True)
    got = {"defaults": tries, "kept": kept_faults}
    assert statistics.median(fresh) > 1000, got  # one fp32 copy of the model: 4,600 pages
    # none in most steps (the heap still grows now and then to a new high-water mark)
    assert statistics.median(kept_faults) < 10 and sum(kept_faults) < 0.3 * sum(fresh), got


class _Branchy(torch.nn.Module):
    """Its second layer counts only for batches whose first input sums above zero: one
    rank's gradients then lack a parameter the other rank's have."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if x[:, 0].sum() > 0 else self.a(x)


def _branchy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch()
    x[: GLOBAL // 2, 0] = x[: GLOBAL // 2, 0].abs() + 0.1  # rank 0 takes the branch
    x[GLOBAL // 2 :, 0] = -x[GLOBAL // 2 :, 0].abs() - 0.1  # rank 1 does not
    return x, y


def _overlap_rank(rank: int, port: int, out: str) -> None:
    _join_two_ranks(rank, port)
    import torch.distributed as dist

    from elastic.config.schema import StrategyConfig
    from elastic.train import reduce
    from elastic.train.batch import BatchPlan
    from elastic.train.engine import build_engine

    mine = slice(rank * GLOBAL // 2, (rank + 1) * GLOBAL // 2)
    overlapping = StrategyConfig(zero_stage=0, overlap_reduce=True)
    assert StrategyConfig().overlap_reduce  # the default: on where it applies
    off = StrategyConfig(zero_stage=0, overlap_reduce=False)
    assert reduce.overlapped_reduce(None, off) is None  # off where asked
    results = {}
    for name, clip, accum in (("mlp", 0.0, 1), ("mlp", 0.5, 1), ("mlp", 0.0, 2), ("branchy", 0, 1)):
        cfg = _cfg(0, clip)
        x, y = _batch() if name == "mlp" else _branchy_batch()
        torch.manual_seed(0)
        model = cfg.model.build() if name == "mlp" else _Branchy()
        plan = BatchPlan.for_world(GLOBAL, 2, GLOBAL // 2 // accum)
        engine = build_engine(cfg, plan, model)
        if name == "branchy":  # a bucket a parameter: rank 1's first ones never fill
            reduce.FIRST_BUCKET_BYTES = reduce.BUCKET_BYTES = 4
        reducer = reduce.overlapped_reduce(engine, overlapping)
        assert reducer is not None and engine.enable_backward_allreduce is False
        buckets = len(reducer.buckets)
        for _ in range(STEPS):
            for xs, ys in zip(x[mine].chunk(accum), y[mine].chunk(accum), strict=True):
                # the loop's weighting: each rank's loss sum x world x accum / global rows
                engine.backward(((engine(xs) - ys) ** 2).sum() * 2 * accum / GLOBAL)
                reducer.finish()
                engine.step()
        params = [p.detach().flatten().tolist() for p in engine.module.parameters()]
        results[f"{name}/{clip}/{accum}"] = {"params": params, "buckets": buckets}
    # a layer frozen during the run: its bucket would be reduced as zeros (and weight
    # decay would still move it), one unfrozen not at all; refused at the step
    engine = build_engine(_cfg(0, 0.0), BatchPlan.for_world(GLOBAL, 2), cfg.model.build())
    reducer = reduce.overlapped_reduce(engine, overlapping)
    x, y = _batch()
    next(engine.module.parameters()).requires_grad_(False)
    engine.backward(((engine(x[mine]) - y[mine]) ** 2).sum())
    try:
        reducer.finish()
        results["frozen"] = "accepted"
    except RuntimeError as e:
        results["frozen"] = str(e)
    # a sparse embedding: left to DeepSpeed, which reduces its sparse gradients
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 3))
    engine = build_engine(_cfg(0, 0.0), BatchPlan.for_world(GLOBAL, 2), sparse)
    results["sparse"] = reduce.overlapped_reduce(engine, overlapping) is None
    # a parameter used inside and outside a reentrant checkpoint takes two gradients in
    # one backward pass: its bucket may be on the wire after the first; refused
    cfg = _cfg(0, 0.0)
    engine = build_engine(cfg, BatchPlan.for_world(GLOBAL, 2), _Branchy())
    reducer = reduce.overlapped_reduce(engine, overlapping)
    x, y = _batch()
    inputs = x[mine].clone().requires_grad_()  # else the reentrant part takes no grads
    twice = torch.utils.checkpoint.checkpoint(engine.module.a, inputs, use_reentrant=True)
    try:
        engine.backward(((twice + engine.module.a(x[mine]) - y[mine]) ** 2).sum())
        results["twice"] = "accepted"
    except RuntimeError as e:
        results["twice"] = str(e)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _branchy_reference() -> list[list[float]]:
    """One process: each half of the batch through the branch its rank took."""
    torch.manual_seed(0)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _branchy_batch()
    for _ in range(STEPS):
        opt.zero_grad()
        halves = [slice(0, GLOBAL // 2), slice(GLOBAL // 2, GLOBAL)]
        loss = sum(((model(x[h]) - y[h]) ** 2).sum() for h in halves) / GLOBAL
        loss.backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def test_the_overlapped_zero0_reduction_updates_as_plain_torch_does(tmp_path):
    """elastic's own ZeRO-0 all-reduce (fp32): the same steps as plain torch over the
    whole global batch, clipping off and on, with 2 micro-steps a step, and with a
    parameter that has a gradient on one rank only, one bucket a parameter (the ranks
    start their all-reduces at different points; the pairs must still match); a
    parameter that takes two gradients in one backward pass, or a layer frozen during
    the run, is refused in words; a sparse embedding is left to DeepSpeed."""
    out = str(tmp_path / "params.json")
    start_ranks(_overlap_rank, (free_port(), out), 2)
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            got = json.load(f)
        assert "two gradients in one backward" in got.pop("twice")
        assert "requires_grad changed" in got.pop("frozen")
        assert got.pop("sparse") is True
        for key, run in got.items():
            name, clip, _ = key.split("/")
            want = _reference(float(clip)) if name == "mlp" else _branchy_reference()
            pairs = zip(run["params"], want, strict=True)
            worst = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in pairs)
            assert worst < 1e-5, (rank, key, worst)
        assert got["branchy/0/1"]["buckets"] == 4  # the one-parameter buckets were in force
    # and the branch one rank skipped did train (on the other rank's gradient)
    torch.manual_seed(0)
    moved = torch.tensor(got["branchy/0/1"]["params"][2]) - _Branchy().b.weight.flatten()
    assert moved.abs().max().item() > 1e-4


X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: avx2\n"
X86_AMX = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\nCPU part\t: 0xd4f\n"
ARM_PLAIN = "processor\t: 0\nFeatures\t: fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(
    ("cpuinfo", "overrides", "warned"),
    [
        (X86_AVX2, ["strategy.precision=bf16"], True),
        (ARM_PLAIN, ["strategy.precision=bf16"], True),
        (X86_AMX, ["strategy.precision=bf16"], False),
        (ARM_BF16, ["strategy.precision=bf16"], False),
        (X86_AVX2, ["strategy.precision=fp32"], False),
        (X86_AVX2, ["strategy.precision=bf16", "scaling.use_gpu=true"], False),
        ("processor\t: 0\n", ["strategy.precision=bf16"], False),  # no flags: no telling
        (None, ["strategy.precision=bf16"], False),  # no /proc/cpuinfo (macOS)
    ],
)
def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_of(tmp_path, cpuinfo, overrides, warned):
    """bf16 on a CPU without bf16 instructions (AVX2-only x86, Arm without its BF16
    extension) is emulated, ~20x slower than fp32 there: the run says so at its start
    (the ``bf16_slow_on_cpu`` event; end to end in tests/test_cbed.py) with the fix. A
    GPU run, fp32, a CPU that has them, or a machine that cannot tell: no warning."""
    from elastic.config.compose import compose, typed_config
    from elastic.train.engine import slow_bf16_warning

    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    cfg, name = compose(["+experiment=smoke", f"run.storage_path={tmp_path}", *overrides])
    got = slow_bf16_warning(typed_config(cfg, name), str(path))
    assert (got is not None) == warned, got
    if warned:
        assert "strategy.precision=fp32" in got["fix"] and "avx512_bf16" in got["missing"]
