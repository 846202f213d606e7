"""memory: model-state bytes per rank of elastic's DeepSpeed engines (ZeRO 0-3, bf16 and
fp32 Adam, 1-3 gloo ranks), measured from the live tensors after a backward pass,
against the ZeRO paper's formulas (the peer): within 10%; and every live tensor of the
rank (model states + DeepSpeed's buffers, :func:`elastic.train.engine.bucket_sizes`)
within 1.2x the formula from ~10M parameters up. Writes bench-memory.json."""

from __future__ import annotations

import argparse

from elastic_bench.common import torchrun_json

HELP = "model-state bytes per rank vs the ZeRO formulas"

# ZeRO paper (Rajbhandari et al. 2020), model-state bytes per parameter on one rank, Adam:
# mixed precision: 2 (bf16 params) + 2 (bf16 grads) + K=12 (fp32 master, momentum,
# variance), partitioned by stage. fp32 equivalents: 4 + 4 + K, where DeepSpeed keeps an
# fp32 master partition even for fp32 params at stages 1-3 (K=12) and stage 0 is the
# plain torch Adam (K=8: moments only).
ZERO_BYTES_PER_PARAM = {
    "bf16": {
        0: lambda n: 16.0,
        1: lambda n: 4 + 12 / n,
        2: lambda n: 2 + 14 / n,
        3: lambda n: 16 / n,
    },
    "fp32": {
        0: lambda n: 16.0,
        1: lambda n: 8 + 12 / n,
        2: lambda n: 4 + 16 / n,
        3: lambda n: 20 / n,
    },
}
MEMORY_TOLERANCE = 0.10  # measured bytes within 10% of the formula
TOTAL_TARGET = 1.2  # every live tensor of a rank over the formula, at most
TOTAL_FROM_PARAMS = 10_000_000  # from this model size up (buffers have floors)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3])
    p.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 3])
    p.add_argument("--precision", nargs="*", choices=["bf16", "fp32"], default=["bf16", "fp32"])
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=12, help="MLP hidden layers")


def _zero_memory(stage: int, precision: str, world: int, hidden: int, layers: int) -> dict:
    args = ["--stage", str(stage), "--precision", precision, "--hidden", str(hidden),
            "--layers", str(layers)]  # fmt: skip
    return torchrun_json(world, "zero_memory.py", args)


def measure(args: argparse.Namespace) -> dict:
    """Model-state bytes per rank of elastic's engines vs the ZeRO paper's formulas."""
    rows = []
    for precision in args.precision:
        for stage in args.stages:
            for world in args.worlds:
                m = _zero_memory(stage, precision, world, args.hidden, args.layers)
                psi = m["psi"]
                worst = max(m["ranks"], key=lambda r: r["model_state_bytes"])
                # the rank that holds the most in all: model states + everything else
                total = max(r["model_state_bytes"] + r["other_bytes"] for r in m["ranks"])
                measured = worst["model_state_bytes"] / psi
                formula = ZERO_BYTES_PER_PARAM[precision][stage](world)
                total_ratio = total / psi / formula
                row = {
                    "precision": precision,
                    "stage": stage,
                    "world": world,
                    "params": psi,
                    "measured_bytes_per_param": measured,
                    "formula_bytes_per_param": formula,
                    "ratio": measured / formula,
                    "within_tolerance": abs(measured / formula - 1) <= MEMORY_TOLERANCE,
                    "note": "",
                    "other_bytes_per_param": worst["other_bytes"] / psi,
                    "total_bytes_per_param": total / psi,
                    "total_ratio": total_ratio,
                    "total_within_target": psi < TOTAL_FROM_PARAMS or total_ratio <= TOTAL_TARGET,
                    "parts_bytes_per_param": {k: v / psi for k, v in worst["parts"].items()},
                }
                if stage == 1 and world > 1:
                    # DeepSpeed runs stage 1 in its stage-2 optimizer: gradients are
                    # reduce-scattered into partitions too, so stage 1 takes less than the
                    # paper's P_os formula; the stage-2 formula is what it implements
                    like2 = measured / ZERO_BYTES_PER_PARAM[precision][2](world)
                    row["ratio_to_stage2_formula"] = like2
                    row["note"] = f"gradients partitioned too: {like2:.2f}x the stage-2 formula"
                rows.append(row)
                print(
                    f"{precision} ZeRO-{stage} x{world}: {measured:.2f} bytes/param measured vs "
                    f"{formula:.2f} formula ({measured / formula:.2f}x; "
                    f"{'within' if row['within_tolerance'] else 'OUTSIDE'} "
                    f"{MEMORY_TOLERANCE:.0%}); all tensors {total / psi:.2f} bytes/param "
                    f"({total_ratio:.2f}x the formula, target <= {TOTAL_TARGET}) "
                    f"{row['note']}",
                    flush=True,
                )
    return {
        "rows": rows,
        "tolerance": MEMORY_TOLERANCE,
        "model": f"MLP 512-{args.hidden}x{args.layers}-8",
        "all_within_tolerance": all(r["within_tolerance"] for r in rows),
        "total_target": TOTAL_TARGET,
        "total_from_params": TOTAL_FROM_PARAMS,
        "all_total_within_target": all(r["total_within_target"] for r in rows),
        "total_ratio_max": max((r["total_ratio"] for r in rows), default=None),
    }
