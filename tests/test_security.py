"""What a local run exposes and leaves behind: a real ``launch/run.py`` in a subprocess."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import stat
from pathlib import Path

import psutil
import pytest
from conftest import small_overrides
from test_cli import Session, _alive, _cli

pytestmark = pytest.mark.slow  # the fast tier: pytest -m 'not slow'

RAY_TOKEN = Path.home() / ".ray" / "auth_token"


def _fingerprint(path: Path) -> tuple | None:
    """What a run must not change: the shared token file's presence, mode and content."""
    if not path.exists():
        return None
    return (stat.S_IMODE(path.stat().st_mode), hashlib.sha256(path.read_bytes()).hexdigest())


def _listening(procs) -> set[str]:
    found = set()
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        found.update(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN)
    return found


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _token_path(procs) -> Path:
    """The token the run's cluster uses, from its GCS server's environment (a C++
    process: Ray does not rewrite its title over the environment)."""
    for p in procs:
        try:
            if p.name() == "gcs_server":
                return Path(p.environ()["RAY_AUTH_TOKEN_PATH"])
        except (psutil.Error, KeyError):
            continue
    raise AssertionError("no gcs_server with RAY_AUTH_TOKEN_PATH among the run's processes")


def test_a_killed_runs_files_go_at_the_next_run_which_listens_on_loopback_only(
    small_data, tmp_path
):
    """A run killed with kill -9 leaves its cluster's directory (and, for a minute or so,
    Ray's agents): the next run removes both, and only those of dead runs. That next
    run: nothing of it (GCS, raylet, agents, Ray workers, torch's TCPStore, gloo) accepts
    connections from another machine; its Ray token is its own, 0600, gone at the end;
    ~/.ray/auth_token is left alone; nothing keeps running, no files stay in /tmp; and no
    "E" line from Ray at start-up reads like an error. (One test: the suite pays for
    two runs, not three.)"""
    before = _fingerprint(RAY_TOKEN)
    args = small_overrides(small_data, tmp_path / "runs", "logger=none", "trainer.max_steps=30")
    killed = Session(_cli([*args, "run.name=killed"], tmp_path))
    killed.wait_for(lambda: "[elastic] connected to" in killed.out)
    killed.watch()
    leftover = Path(f"/tmp/elastic-ray-{killed.proc.pid}")
    assert leftover.is_dir()
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.finish()

    run = Session(_cli([*args, "run.name=local"], tmp_path))
    run.wait_for(lambda: "[elastic] connected to" in run.out)
    assert not leftover.exists(), "the killed run's directory is still there"
    assert not [p.pid for p in killed.seen.values() if _alive(p)], "its processes still run"
    assert Path(f"/tmp/elastic-ray-{run.proc.pid}").is_dir()  # a live run's is kept
    # the process group is up (gloo and the TCPStore listen from here on) once a step is done
    run.wait_for(lambda: "[elastic] step " in run.out or "[elastic] progress" in run.out)
    run.watch()
    procs = [psutil.Process(run.proc.pid), *run.seen.values()]
    listening = _listening(procs)
    token = _token_path(procs)
    token_mode = stat.S_IMODE(token.stat().st_mode)
    parent_mode = stat.S_IMODE(token.parent.stat().st_mode)
    assert run.finish() == 0, run.out

    assert listening, "found no listening socket at all: the check itself is broken"
    exposed = sorted(ip for ip in listening if not _loopback(ip))
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert token_mode == 0o600 and parent_mode == 0o700
    assert token != RAY_TOKEN and not token.exists() and not token.parent.exists()
    assert _fingerprint(RAY_TOKEN) == before
    assert run.left_running() == []
    assert " E " not in run.out and "core_worker.cc" not in run.out, run.out
