"""bench.py scale: the laws it fits against series whose law is known, what it reads
from a run's records, and its model-size and dataset-size series on the real engines,
ledger and checks, each against an independent count (the ZeRO-3 checkpoint's 12 bytes
a parameter, a bitmap's bit a sample)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from elastic_bench.scale.fit import fit
from elastic_bench.scale.plot import markdown
from elastic_bench.scale.world import epoch_start_s
from elastic_harness.localcluster import REPO

SIZES = [2, 4, 8, 16, 24]


@pytest.mark.parametrize(
    ("law", "expected"),
    [
        (lambda x: 7.0 + 0 * x, "constant"),
        (lambda x: 3 + 2 * np.log(x), "log"),
        (lambda x: 1 + 0.5 * x, "linear"),
        (lambda x: 1 + x + 0.5 * x * x, "quadratic"),
    ],
)
def test_the_law_kept_is_the_one_the_series_follows(law, expected):
    rng = np.random.default_rng(0)
    x = np.array(SIZES, float)
    for noise in (0.0, 0.03):  # exact, and 3% noise a point
        y = law(x) * (1 + noise * rng.standard_normal(len(x)))
        found = fit(list(x), list(y))
        assert found.model == expected, (noise, found)
        # carried out to a 6,000-worker machine, within the noise's reach of the truth
        assert found.at(6000) == pytest.approx(law(np.array(6000.0)), rel=0.05 + 10 * noise)
    assert fit(list(x), list(law(x))).superlinear == (expected == "quadratic")


def test_noise_around_a_flat_cost_stays_flat():
    """Five noisy points of a constant cost: no slope is invented from the noise."""
    for seed in range(5):
        y = 10 * (1 + 0.1 * np.random.default_rng(seed).standard_normal(5))
        assert fit(SIZES, list(y)).model == "constant", seed


def test_a_line_through_two_points_is_never_carried_out():
    """Two noisy sizes of a flat cost make a steep line; nothing tested it."""
    law = fit([8, 16], [17.1, 19.5])
    assert law.model == "linear" and not law.trusted
    assert "2 sizes" in law.refusal
    assert fit([2, 8, 16], [17.5, 17.1, 19.5]).trusted


def test_a_parabola_opening_downward_is_never_carried_out():
    """A cost that grows more slowly than a line must not be carried out as a parabola
    that turns over: measured on 2026-12-05 (a ZeRO-3 checkpoint's write, 1M-300M
    parameters) it came out at -8.9 s for 1B parameters."""
    sizes = [1e6, 3e6, 1e7, 3e7, 1e8, 3e8]
    write_s = [0.093, 0.06, 0.295, 0.659, 2.12, 4.33]
    for x, y in ((sizes, write_s), (SIZES, [5 * v**0.5 for v in SIZES])):
        law = fit(x, y)
        assert law.model != "quadratic", law
        if law.trusted:  # carried out, it keeps growing: never below the largest measured
            assert law.at(10 * x[-1]) >= y[-1], law
            assert law.at(1000 * x[-1]) >= law.at(10 * x[-1]), law


def test_a_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="2 or more"):
        fit([4], [1.0])
    with pytest.raises(ValueError, match="positive"):
        fit([0, 4, 8], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="finite"):
        fit([2, 4, 8], [1.0, float("nan"), 3.0])


def test_an_epoch_start_is_the_extra_wait_of_the_interval_holding_it():
    """Log records every 8 steps; the epoch ends at step 32: the interval (32, 40]
    holds the next epoch's first step and waited 0.5 s longer on its slowest rank."""
    records, t = [], 0.0
    for step in range(8, 81, 8):
        t += 0.4
        slowest = 0.01 + (0.5 / 8 if step == 40 else 0.0)  # per step, over the interval
        waits = {"worker_data_wait_s/rank0": 0.01, "worker_data_wait_s/rank1": slowest}
        records.append({"step": step, "time": t, "train/loss": 1.0, **waits})
    records.append({"step": 32, "time": 1.6, "event": "epoch_end"})
    assert epoch_start_s(records, world=2) == pytest.approx(0.5)
    assert epoch_start_s([r for r in records if "event" not in r], world=2) is None


@pytest.mark.slow
def test_bench_scale_model_and_data_series(tmp_path):
    """The model-size and dataset-size series from the command line: real ZeRO-3 engines
    on 2 and 3 gloo ranks, the real ledger and checks; a checkpoint holds 12 bytes a
    parameter (fp32 weights and two Adam moments), the mid-epoch bitmap a bit a sample,
    the checks read more shards in more time; every series has its law."""
    cmd = [sys.executable, str(REPO / "launch/bench.py"), "scale", "--skip", "world",
           "--params", "1e6", "2e6", "4e6", "--samples", "1e6", "1e7", "1e8",
           "--merged", "1e4", "1e5", "1e6"]  # fmt: skip
    subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)
    report = json.loads((tmp_path / "bench-scale.json").read_text())
    s = report["series"]
    for p in report["points"]["model"]:
        assert p["bytes"] == pytest.approx(12 * p["params"], rel=0.02)
        assert p["save_s"] > 0 and p["load_s"] > 0 and p["reshard_load_s"] > 0
    for p in report["points"]["data"]["ledger"]:  # random bits: stored as they are
        assert p["bytes"] == pytest.approx(p["samples"] / 8, rel=0.01)
    checks = report["points"]["data"]["checks"]
    assert [c["shards"] for c in checks] == [10, 100, 1000]
    assert checks[-1]["row_groups"] == 10_000
    assert checks[-1]["state_bytes"] > 10 * checks[0]["state_bytes"]  # it names every shard
    assert s["checkpoint.bytes"]["fit"]["model"] == "linear"
    assert s["checkpoint.bytes"]["at"]["1B params"] == pytest.approx(12e9, rel=0.05)
    assert s["ledger.bytes"]["at"]["10^10 samples"] == pytest.approx(1.25e9, rel=0.05)
    for name in ("ledger.merge_s", "data.config_s", "checkpoint.reshard_load_s"):
        # timed on a busy machine from 3 small sizes: modelled, or refused in words
        found = s[name]
        assert "fit" in found and (set(found.get("at", {})) or "misses" in found["not_modelled"])
    table = markdown(report)
    assert table.count("\n") == len(s) + 2
    assert sorted(p.name for p in tmp_path.glob("bench-scale-*.png")) == [
        "bench-scale-data.png",
        "bench-scale-model.png",
    ]


CLOCK_SCRIPT = """
import json, os, time
import ray
from elastic_harness.localcluster import FAST_HEALTH, CpuClock, RayCluster

# processes started ahead for the driver, as at Ray's default (elastic's nodes start
# none): Ray gives one to the first actor (it does not to a task's process)
cluster = RayCluster(0, system_config={**FAST_HEALTH, "prestart_worker_first_driver": True})
try:
    ray.init(address=cluster.address)
    clock = CpuClock(cluster, period_s=0.1)
    deadline = time.monotonic() + 60
    while not {"ray_idle", "ray::IDLE"} & set(clock.head_kinds[-1]):
        assert time.monotonic() < deadline, clock.head_kinds[-1]
        time.sleep(0.2)
    seen_idle = set(clock._last)

    @ray.remote(num_cpus=0)
    class Burner:
        def pid(self):
            return os.getpid()

        def burn(self, seconds):
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass

    burner = Burner.remote()
    pid = ray.get(burner.pid.remote())
    time.sleep(0.5)
    t0 = time.time()
    ray.get(burner.burn.remote(1.5))
    time.sleep(0.5)
    by_kind = clock.head_by_kind(t0, time.time())
    clock.stop()
    kinds = sorted(clock.head_kinds[-1])
    print(json.dumps({"seen_idle": pid in seen_idle, "by_kind": by_kind, "kinds": kinds}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_the_cpu_clock_files_a_pooled_worker_under_what_it_became():
    """bench scale's head-side CPU by kind of process (``head_cpu_by_process``): a Ray
    worker process seen idle in the pool and then given an actor spends its seconds from
    then on as that actor. (The kind was fixed at first sight: every actor on the head,
    Ray Train's controller among them, was filed as an idle pooled worker.) The raylet is
    itself, not a pooled worker (its arguments name the worker's script: it was filed as
    one, ~0.9% of a core that bench overhead called idle workers). In a process of its
    own: its driver joins a cluster of its own, not the session's Ray."""
    out = subprocess.run(
        [sys.executable, "-c", CLOCK_SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["seen_idle"], "Ray gave the actor a process the clock never saw idle"
    assert found["by_kind"].get("ray::Burner", 0.0) >= 1.2, found
    assert found["by_kind"].get("ray_idle", 0.0) + found["by_kind"].get("ray::IDLE", 0.0) < 0.5
    assert {"raylet", "gcs_server"} <= set(found["kinds"]), found["kinds"]
