"""gpu: cbed_vit at ViT-L size (~300M parameters) in bf16, one worker per visible NVIDIA
GPU (NCCL): steady-state samples/s and model FLOPs utilisation (FLOPs counted by torch's
FlopCounterMode, over the GPU's dense bf16 peak). Needs a GPU; --cpu-check runs the same
path small on CPU. Writes bench-gpu.json."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from elastic_bench.common import train

HELP = "samples/s and MFU of cbed_vit at ViT-L size on GPUs"

# dense bf16 tensor-core peak per GPU (vendor datasheets, TFLOP/s), matched in the name
GPU_PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)
VIT_L = ["model.dim=1024", "model.depth=24", "model.heads=16"]
VIT_CPU_CHECK = ["model.dim=64", "model.depth=2", "model.heads=4"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--batch-per-gpu", type=int, default=64)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--cpus-per-gpu", type=float, default=2)
    p.add_argument("--cache-mb", type=float, default=4096)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--data-dir", default="data/bench-gpu", help="generated once, reused")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak, if unknown")
    p.add_argument("--cpu-check", action="store_true", help="the same path, small, on CPU")


def flops_per_sample(overrides: list[str]) -> tuple[float, int]:
    """Training FLOPs (forward + backward) per sample of the composed experiment's model,
    counted by torch's FlopCounterMode on the meta device (no memory, no data), and its
    parameter count."""
    from torch.utils.flop_counter import FlopCounterMode

    from elastic.config.compose import compose
    from elastic.config.validate import to_typed

    cfg = to_typed(compose(overrides)[0])
    with torch.device("meta"):
        model = cfg.model.build()
    width = cfg.model.input_dim
    shape = (8, width) if width else (8, cfg.model.in_channels, cfg.model.side, cfg.model.side)
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(shape, device="meta")).float().sum().backward()
    return counter.get_total_flops() / 8, sum(p.numel() for p in model.parameters())


def measure(args: argparse.Namespace) -> dict:
    """Samples/s and model FLOPs utilisation of cbed_vit at ViT-L size, bf16, one worker
    per GPU, steady state (log intervals after the warm-up steps)."""
    import torch.cuda

    from elastic.datasets.cbed import Settings, synthetic

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.cpu_check:
        raise SystemExit(
            "bench gpu: no CUDA GPU here (torch.cuda.is_available() is False): run it on a "
            "GPU node, or add --cpu-check to run the same path small on CPU"
        )
    gpus = torch.cuda.device_count() if on_gpu else 1
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    peak = args.peak_tflops or next((t for k, t in GPU_PEAK_BF16_TFLOPS if k in name), None)
    data = Path(args.data_dir)
    if not (data / "train").is_dir():
        synthetic(data, args.rows, Settings(size=64), val_fraction=0.0, shards=16)
    model = VIT_L if on_gpu else VIT_CPU_CHECK
    overrides = [
        "+experiment=cbed_vit", *model, f"data.path={data}/train", "data.val_path=null",
        f"data.global_batch_size={args.batch_per_gpu * gpus}", f"scaling.workers={gpus}",
        f"scaling.use_gpu={str(on_gpu).lower()}", "strategy.precision=bf16",
        f"strategy.zero_stage={args.zero_stage}", f"scaling.cpus_per_worker={args.cpus_per_gpu}",
        f"data.cache_mb={args.cache_mb}",
    ]  # fmt: skip
    flops, params = flops_per_sample(overrides)
    steps = args.steps if on_gpu else 40
    workdir = tempfile.mkdtemp(prefix="elastic-bench-")
    try:
        records, summary = train(overrides, steps, workdir, "gpu")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    records = [r for r in records if "train/loss" in r]
    warm = [r for r in records if r["step"] >= min(args.warmup_steps, steps // 2)]
    span_s = warm[-1]["time"] - warm[0]["time"]
    samples_per_s = (warm[-1]["step"] - warm[0]["step"]) * args.batch_per_gpu * gpus / span_s
    achieved = samples_per_s * flops
    report = {
        "device": name,
        "gpus": gpus,
        "params": params,
        "model": "cbed_vit " + " ".join(model),
        "flops_per_sample": flops,
        "samples_per_s": samples_per_s,
        "achieved_tflops_per_gpu": achieved / gpus / 1e12,
        "peak_bf16_tflops_per_gpu": peak,
        "mfu": achieved / (gpus * peak * 1e12) if peak and on_gpu else None,
        "data_wait": summary["time_breakdown"]["data_wait"],
        "time_breakdown": summary["time_breakdown"],
        "setup": {"overrides": overrides, "steps": steps, "warmup_steps": args.warmup_steps},
        "date": time.strftime("%Y-%m-%d"),
    }
    mfu = f"{100 * report['mfu']:.1f}%" if report["mfu"] is not None else "n/a (no GPU peak)"
    print(
        f"gpu: {name} x{gpus}, {params / 1e6:.1f}M params, {flops / 1e9:.3g} GFLOP/sample: "
        f"{samples_per_s:,.0f} samples/s, {report['achieved_tflops_per_gpu']:.3g} TFLOP/s per "
        f"device, MFU {mfu}; data wait {100 * report['data_wait']:.1f}% of the run"
    )
    return report
