"""The ``bench all`` run and its table: every benchmark in turn, each figure beside its
peer and its target (the targets are the benchmark modules' own constants) in one
Markdown table (bench-all.md) and bench-all.json."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import ModuleType

from elastic_bench import (
    chaos,
    gpu,
    hetero,
    ingest,
    memory,
    overhead,
    recovery,
    scale,
    startup,
    torchft_eval,
)

# each benchmark's module: HELP, add_arguments(parser), measure(args) -> its report;
# in the order the CLI lists them
BENCHES: dict[str, ModuleType] = {
    "overhead": overhead,
    "recovery": recovery,
    "chaos": chaos,
    "ingest": ingest,
    "memory": memory,
    "hetero": hetero,
    "gpu": gpu,
    "startup": startup,
    "scale": scale,
    "torchft": torchft_eval,
}
ALL_ORDER = ("overhead", "ingest", "recovery", "chaos", "hetero", "memory", "scale")
QUICK = {  # --quick: fewer rounds and steps, same figures (noisier)
    "overhead": ["--rounds", "1", "--steps", "400"],
    "ingest": ["--rounds", "1", "--wait-steps", "60"],
    "recovery": ["--rounds", "1"],
    "chaos": ["--epochs", "10"],
    "memory": ["--precision", "bf16"],
    "hetero": ["--rounds", "1"],
    "scale": ["--quick"],
}


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def _table_rows(results: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, elastic, peer, ratio, target, verdict) for every measured figure."""
    rows: list[tuple[str, str, str, str, str, str]] = []
    if o := results.get("overhead"):
        # one row a ZeRO stage (a JSON from before the stages: its one figure, vs DDP)
        stages = o.get("stages") or {"0": {**o, "peer_step_s": o["torchrun_step_s"]}}
        labels = []
        for stage, v in stages.items():
            peer = (
                "torchrun DDP"
                if v.get("peer", "torchrun_ddp") == "torchrun_ddp"
                else f"torchrun DeepSpeed ZeRO-{stage}"
            )
            labels.append(peer)
            rows.append((
                f"step time, steady state (smoke, ZeRO-{stage}, 2 workers)",
                f"{v['elastic_step_s'] * 1e3:.1f} ms", f"{v['peer_step_s'] * 1e3:.1f} ms ({peer})",
                f"{v['ratio']:.2f}" + (
                    f" (95% {v['ratio_ci_low']:.2f}-{v['ratio_ci_high']:.2f})"
                    if v.get("ratio_ci_high") is not None else " (1 round)"
                ),
                f"<= {overhead.STEP_RATIO_TARGET}",
                _verdict(None if v.get("ratio_ci_high") is None
                         else v["ratio_ci_high"] <= overhead.STEP_RATIO_TARGET),
            ))  # fmt: skip
        rows.append((
            "step time, first epoch (Parquet decoded on the same cores)",
            f"{o['elastic_first_epoch_step_s'] * 1e3:.1f} ms",
            f"{o['torchrun_step_s'] * 1e3:.1f} ms ({labels[0]})",
            f"{o['ratio_first_epoch']:.2f}", "", "n/a",
        ))  # fmt: skip
    for name, d in (results.get("ingest") or {}).get("datasets", {}).items():
        dl = f"{d['dataloader_rows_per_s']:,.0f} (DataLoader, 2 procs)"
        if d["cached"]:
            before = ingest.CACHED_BEFORE.get(name)
            rows.append((
                f"ingest {name}, rows/s into 2 workers (each row group read once a worker)",
                f"{d['elastic_rows_per_s']:,.0f}", dl, f"{d['ratio']:.2f}",
                "" if before is None else f"not worse than {before:.2f}",
                _verdict(None if before is None
                         else d["ratio"] >= before * (1 - ingest.CACHED_NOISE)),
            ))  # fmt: skip
        rows.append((
            f"ingest {name}, streamed every epoch (larger than data.cache_mb)",
            f"{d['elastic_streamed_rows_per_s']:,.0f}", dl, f"{d['ratio_streamed']:.2f}",
            f">= {ingest.STREAMED_RATIO_TARGET}",
            _verdict(d["ratio_streamed"] >= ingest.STREAMED_RATIO_TARGET),
        ))  # fmt: skip
        if d.get("ratio_streamed_later") is not None:
            rows.append((
                f"ingest {name}, streamed, after the first epoch (Ray Data's start behind)",
                f"{d['elastic_streamed_later_rows_per_s']:,.0f}",
                f"{d['dataloader_later_rows_per_s']:,.0f} (DataLoader, after its first epoch)",
                f"{d['ratio_streamed_later']:.2f}", "", "n/a",
            ))  # fmt: skip
        steady = d["data_wait"]["steady"]
        rows.append((
            f"data wait, {d['experiment']} (steady state)",
            "n/a" if steady is None else f"{100 * steady:.1f}%", "", "",
            f"<= {100 * ingest.DATA_WAIT_TARGET:.0f}%",
            _verdict(None if steady is None else steady <= ingest.DATA_WAIT_TARGET),
        ))  # fmt: skip
    if r := results.get("recovery"):
        for key, label, target in (
            ("shrink_s", "node killed -> first step at 1 worker", recovery.SHRINK_TARGET_S),
            ("grow_s", "node added -> first step at 2 workers", recovery.GROW_TARGET_S),
            ("worker_kill_s", "worker SIGKILL -> next step", None),
        ):
            rows.append((
                label, f"{r[key]:.1f} s", f"{r[key + '_ray_defaults']:.1f} s (Ray Train defaults)",
                f"{r[key + '_ratio']:.2f}", "" if target is None else f"<= {target:.0f} s",
                _verdict(None if target is None else r[key] <= target),
            ))  # fmt: skip
        if live := r.get("live"):
            faults = ", ".join(k.replace("_", " ") for k in live["covered"])
            rows.append((
                f"live (scaling.live, 3 workers): survivors' stall, worst of {faults}",
                f"{live['stall_s']:.2f} s",
                f"{live['restart_worker_kill_s']:.1f} s (restart: worker SIGKILL -> next step)",
                f"{live['stall_ratio_vs_restart']:.2f}", f"<= {recovery.LIVE_STALL_TARGET_S:.0f} s",
                _verdict(live["stall_s"] <= recovery.LIVE_STALL_TARGET_S),
            ))  # fmt: skip
            rows.append((
                "live: committed steps lost; survivors restarted (worst)",
                f"{live['steps_lost']}; {live['survivor_restarts']}", "", "",
                f"<= {recovery.LIVE_STEPS_LOST_TARGET}; 0",
                _verdict(
                    live["steps_lost"] <= recovery.LIVE_STEPS_LOST_TARGET
                    and live["survivor_restarts"] == 0
                ),
            ))  # fmt: skip
            rows.append((
                "live: fault -> newcomer joined with the state copied from a survivor (worst)",
                f"{live['heal_s']:.1f} s", "", "", "", "n/a",
            ))  # fmt: skip
        rows.append((
            f"checkpoint share of wall time (every {r['checkpoint_every_steps']} steps)",
            f"{100 * r['checkpoint_overhead']:.2f}%", "", "",
            f"<= {100 * recovery.CHECKPOINT_SHARE_TARGET:.0f}%",
            _verdict(r["checkpoint_overhead"] <= recovery.CHECKPOINT_SHARE_TARGET),
        ))  # fmt: skip
    if c := results.get("chaos"):
        clean, t = c["runs"]["clean"]["val_loss"], c["targets"]
        rows.append((
            f"val loss after {sum(c['actions'].values())} kills/removals/additions",
            f"{c['runs']['chaos']['val_loss']:.5f}", f"{clean:.5f} (the same run, undisturbed)",
            f"{1 + c['val_loss_rel_gap']:.5f}",
            f"within {100 * t['val_loss_rel_gap']:.2f}%, every sample once, same batches",
            _verdict(c["finished"] and c["samples_exactly_once"] and c["same_global_batches"]
                     and c["val_loss_rel_gap"] <= t["val_loss_rel_gap"]),
        ))  # fmt: skip
        rows.append((
            "largest per-step training loss difference, chaos vs clean",
            f"{c['max_step_loss_rel_diff']:.1e}", "", "", "", "n/a",
        ))  # fmt: skip
        rows.append((
            "largest per-step loss difference, 1 vs 2 vs 3 workers (100 steps)",
            f"{c['world_size_loss_rel_diff']:.1e}", "", "",
            f"<= {t['world_size_loss_rel_diff']:.0e}, same batches",
            _verdict(c["world_sizes_same_global_batches"]
                     and c["world_size_loss_rel_diff"] <= t["world_size_loss_rel_diff"]),
        ))  # fmt: skip
        fb = c["data_ready_s"]
        rows.append((
            "worker group start -> its first batch read (median of the chaos run's starts; max)",
            f"{fb['median']:.2f} s; {fb['max']:.2f} s", "", "", f"<= {t['data_ready_s']:.0f} s",
            _verdict(fb["max"] <= t["data_ready_s"]),
        ))  # fmt: skip
    if h := results.get("hetero"):
        t = h["targets"]
        if h["rebalance_samples_per_s"] is None:  # every round refused (hetero._round)
            refused = f"refused: no valid round of {len(h['rounds'])}"
            for figure in ("rebalance vs lock-step", "the same: rebalance vs the ideal"):
                rows.append((
                    f"samples/s, 2 workers, one slowed ~2x: {figure}", refused, "", "", "",
                    "NOT met",
                ))  # fmt: skip
        else:
            of = f" of {len(h['rounds'])}" if "valid_rounds" in h else ""
            rounds = f"{h.get('valid_rounds', len(h['rounds']))} valid rounds{of}"
            rows.append((
                "samples/s, 2 workers, one slowed ~2x: rebalance vs lock-step",
                f"{h['rebalance_samples_per_s']:,.0f}",
                f"{h['lockstep_samples_per_s']:,.0f} (lock-step, stragglers.policy=report)",
                f"{h['rebalance_vs_lockstep']:.2f} ({rounds}: "
                f"{h['rebalance_vs_lockstep_min']:.2f}-{h['rebalance_vs_lockstep_max']:.2f})",
                f">= {t['rebalance_vs_lockstep']}",
                _verdict(h["rebalance_vs_lockstep_min"] >= t["rebalance_vs_lockstep"]),
            ))  # fmt: skip
            rows.append((
                "samples/s, the same: rebalance vs the ideal",
                f"{h['rebalance_samples_per_s']:,.0f}",
                f"{h['ideal_samples_per_s']:,.0f} (each worker's samples/s alone, summed)",
                f"{h['rebalance_vs_ideal']:.2f} ({rounds}: "
                f"{h['rebalance_vs_ideal_min']:.2f}-{h['rebalance_vs_ideal_max']:.2f})",
                f">= {t['rebalance_vs_ideal']}",
                _verdict(h["rebalance_vs_ideal_min"] >= t["rebalance_vs_ideal"]),
            ))  # fmt: skip
    if m := results.get("memory"):
        by: dict[tuple[str, int], list[dict]] = {}
        for row in m["rows"]:
            by.setdefault((row["precision"], row["stage"]), []).append(row)
        for (precision, stage), cells in by.items():
            worlds = "/".join(str(c["world"]) for c in cells)
            worst = max(cells, key=lambda c: abs(c["ratio"] - 1))
            to2 = [
                f"{c['ratio_to_stage2_formula']:.2f}"
                for c in cells
                if "ratio_to_stage2_formula" in c
            ]
            notes = f"gradients partitioned too: {'/'.join(to2)}x the stage-2 formula"
            notes = notes if to2 else ""
            verdict = _verdict(all(c["within_tolerance"] for c in cells))
            outside = [c for c in cells if not c["within_tolerance"]]
            if outside and all(c["ratio"] < 1 and "ratio_to_stage2_formula" in c for c in outside):
                verdict = "below the formula"  # stage 1: DeepSpeed partitions more
            rows.append((
                f"model-state bytes/param, ZeRO-{stage} {precision}, N={worlds}",
                " / ".join(f"{c['measured_bytes_per_param']:.2f}" for c in cells),
                " / ".join(f"{c['formula_bytes_per_param']:.2f}" for c in cells)
                + " (ZeRO formula)",
                f"{worst['ratio']:.2f}", f"within {100 * m['tolerance']:.0f}%",
                verdict + (f" ({notes})" if notes else ""),
            ))  # fmt: skip
            judged = [c for c in cells if "total_ratio" in c]
            if judged:
                rows.append((
                    f"all tensors, bytes/param, ZeRO-{stage} {precision}, N={worlds}",
                    " / ".join(f"{c['total_bytes_per_param']:.2f}" for c in judged),
                    " / ".join(f"{c['formula_bytes_per_param']:.2f}" for c in judged)
                    + " (ZeRO formula)",
                    f"{max(c['total_ratio'] for c in judged):.2f}",
                    f"<= {m['total_target']} from {m['total_from_params'] / 1e6:g}M params",
                    _verdict(all(c["total_within_target"] for c in judged)),
                ))  # fmt: skip
    if sc := results.get("scale"):
        rows += _scale_rows(sc)
    return rows


def _scale_rows(report: dict) -> list[tuple[str, str, str, str, str, str]]:
    """bench scale: each series with a budget, at its first modelled size (1,000 nodes
    of 6 workers; 1B parameters; 10^10 samples), beside what was measured."""
    rows = []
    for name, s in report["series"].items():
        if "budget" not in s or not s.get("at"):
            continue
        label, value = next(iter(s["at"].items()))
        unit = s.get("unit", "")
        sizes = s.get("world_sizes") or s.get("sizes") or []
        measured = s.get("values") or []
        here = f" (measured {measured[-1]:.3g} {unit} at {sizes[-1]:g})" if measured else ""
        over = s.get("over_budget_from")
        rows.append((
            f"scale `{name}`: {s['what']}, modelled at {label}",
            f"{value:.3g} {unit}{here}", "", "",
            f"<= {s['budget']:g} {unit}" + ("" if over is None else f" (past it from {over:.3g})"),
            _verdict(value <= s["budget"]),
        ))  # fmt: skip
    return rows


def markdown_table(results: dict) -> str:
    lines = [
        "| figure | elastic | peer | ratio | target | verdict |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _table_rows(results)]
    return "\n".join(lines) + "\n"


def run_all(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every benchmark in turn with its own defaults (``--quick``: fewer rounds); each
    writes its own bench-NAME.json as well; one failing does not stop the others."""
    results: dict = {}
    errors: dict[str, str] = {}
    for name in ALL_ORDER:
        if name in args.skip:
            continue
        sub_args = parser.parse_args([name, *(QUICK[name] if args.quick else [])])
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            results[name] = BENCHES[name].measure(sub_args)
        except Exception as e:  # report it and go on: the table shows what was measured
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {errors[name]}", flush=True)
            continue
        results[name]["bench_s"] = time.perf_counter() - start
        Path(f"bench-{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
    table = markdown_table(results)
    Path("bench-all.md").write_text(table)
    print(table)
    return {
        "results": results,
        "errors": errors,
        "table": table,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
    }
