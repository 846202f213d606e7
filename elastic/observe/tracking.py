"""Rank-0 tracking: console lines, a metrics history file and W&B.

Rank 0 gets a :class:`Tracker`; every other rank gets a :class:`NullTracker` with the same
methods, so the loop never asks ``if rank == 0`` to log.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import time
from typing import Any

from elastic.observe.settings import LoggerConfig

STEP_KEY = "trainer/step"
HISTORY_FILE = "metrics.jsonl"


def finite(obj: Any) -> Any:
    """``obj`` with every nan/inf float as None: JSON has no such numbers, and a bare
    ``NaN`` makes the whole file unreadable to strict parsers (jq, JavaScript, W&B)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: Any, indent: int | None = None) -> str:
    """Strict JSON (non-finite floats as null; never a bare NaN)."""
    return json.dumps(finite(obj), indent=indent, allow_nan=False)


# seconds between W&B's flushes of the run's transaction log (see Tracker)
FLUSH_S = 1.0
# events worth a W&B alert: the job lost or regained workers, was stopped, a rank is
# slowing every step down, or bf16 runs emulated on a CPU without bf16 instructions
ALERTS = (
    "restart",
    "preempted",
    "node_drain",
    "straggler",
    "bf16_slow_on_cpu",
    "val_rows_left_out",
)


def wandb_key_configured() -> bool:
    """True when this user has a W&B API key (env or ~/.netrc), so online mode can work."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_mode(cfg: LoggerConfig) -> str:
    """``WANDB_MODE`` wins, then logger.mode; ``auto`` is online only with a key."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if wandb_key_configured() else "offline"


class NullTracker:
    wandb_dir: str | None = None
    run_id: str | None = None

    def log(self, step: int, metrics: dict[str, Any], console: str | None = None) -> None:
        """Record metrics of ``step``; print ``console`` as the human-readable line."""

    def event(self, step: int, kind: str, **info: Any) -> None:
        """Record something that happened to the run (resume, world-size change, ...)."""

    def finish(self) -> None:
        """Flush and close."""


class Tracker(NullTracker):
    def __init__(
        self,
        cfg: LoggerConfig,
        run_dir: str,
        run_name: str,
        experiment: str,
        config: dict[str, Any],
        run_id: str | None,
    ) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self._history = open(os.path.join(run_dir, HISTORY_FILE), "a")  # noqa: SIM115
        self._wandb: Any = None
        self._name = run_name
        if cfg.kind == "wandb":
            import wandb

            # one W&B run for the whole run, also across a restart before any checkpoint
            id_file = os.path.join(run_dir, "wandb_run_id")
            if run_id is None and os.path.exists(id_file):
                with open(id_file) as f:
                    run_id = f.read().strip() or None

            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", cfg.project),
                entity=os.environ.get("WANDB_ENTITY", cfg.entity),
                name=run_name,
                group=experiment or None,
                id=run_id,
                resume="allow",
                dir=os.environ.get("WANDB_DIR", run_dir),
                mode=wandb_mode(cfg),  # type: ignore[arg-type]
                config=config,
                settings=wandb.Settings(
                    console="off",
                    x_disable_stats=True,
                    silent=True,
                    # a worker group is killed, not finished, on every elastic restart:
                    # what W&B had not flushed to the run's file is lost (15 s by
                    # default; a whole 32 KiB block was lost in our shrink test)
                    x_transaction_log_flush_interval=FLUSH_S,
                ),
            )
            self.run_id = self._wandb.id
            with open(id_file, "w") as f:
                f.write(self.run_id)
            self.wandb_dir = os.path.dirname(self._wandb.dir)
            # Our own step axis: after a failure the run goes back to its last checkpoint
            # and logs those steps again; W&B drops a `step=` that goes backwards.
            self._wandb.define_metric(STEP_KEY)
            self._wandb.define_metric("*", step_metric=STEP_KEY)

    def log(self, step: int, metrics: dict[str, Any], console: str | None = None) -> None:
        self._write({"step": step, "time": time.time(), **metrics})
        if self._wandb is not None:
            self._wandb.log({**metrics, STEP_KEY: step})
        if console:
            print(console, flush=True)

    def event(self, step: int, kind: str, **info: Any) -> None:
        self._write({"step": step, "time": time.time(), "event": kind, **info})
        if self._wandb is not None:  # numbers chart; the full record is in metrics.jsonl
            numbers = {
                f"event/{kind}/{k}": v
                for k, v in info.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self._wandb.log({f"event/{kind}": 1, **numbers, STEP_KEY: step})
        detail = " ".join(f"{k}={v}" for k, v in info.items())
        if self._wandb is not None and kind in ALERTS:
            # a W&B alert (Slack/email when the user has set them up); also offline,
            # where it is sent when the run is synced
            self._wandb.alert(
                title=f"{self._name}: {kind}",
                text=f"at step {step}: {detail}",
                level="WARN",
                wait_duration=0,
            )
        print(f"[elastic] {kind} at step {step}: {detail}", flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        self._history.write(json_text(record) + "\n")
        self._history.flush()

    def finish(self) -> None:
        self._history.close()
        if self._wandb is not None:
            self._wandb.finish()


def make_tracker(rank: int, **kwargs: Any) -> NullTracker:
    return Tracker(**kwargs) if rank == 0 else NullTracker()
