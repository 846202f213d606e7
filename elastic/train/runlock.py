"""One run per run folder at a time: a lock file in it, held by the driver.

A second start of the same ``run.name`` (and ``run.storage_path``) while the first runs
would resume from the first's checkpoint, and its worker group would delete the first's
newest checkpoint as unregistered. So the driver takes an exclusive ``flock`` on
``<run>/.lock`` for as long as it lives, and writes its host, pid and start time there
(what a refused start names). The lock goes with the process however it ends (kill -9
included); a file whose lock can be taken but which names a holder is a dead run's,
taken over and said so. The file itself stays (emptied at a clean end): removing it
would let two starts lock two different files.

On a filesystem without ``flock`` (some parallel filesystems mount without it) the
named holder decides: on this host, alive or not; on another host it cannot be told,
and the start is refused with the way out (delete the file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator

from elastic.errors import ConfigError

LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_lock(run_dir: str) -> Iterator[str | None]:
    """Hold the run's lock for the block; yields a line to print when a dead run's lock
    was taken over (else None). A :class:`ConfigError` (one line naming the holder) when
    another process holds it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        previous = _holder(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(_in_use(run_dir, previous, path)) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            if previous and not _gone(previous):  # no locks here: the holder decides
                raise ConfigError(_in_use(run_dir, previous, path, locks=False)) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        _write(fd, json.dumps(me))
        taken = None
        if previous:
            taken = (
                f"run {run_dir} was left locked by pid {previous.get('pid')} on "
                f"{previous.get('host')}, which is gone: lock taken over"
            )
        try:
            yield taken
        finally:
            _write(fd, "")
    finally:
        os.close(fd)  # releases the flock


def _holder(fd: int) -> dict[str, object]:
    """Who the lock file names (empty: nobody, or unreadable)."""
    try:
        text = os.pread(fd, 4096, 0).decode()
        found = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _gone(holder: dict[str, object]) -> bool:
    """Whether the named holder is known not to run (only on this host can we tell)."""
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # somebody else's process: alive
        return False
    return False


def _in_use(run_dir: str, holder: dict[str, object], path: str, locks: bool = True) -> str:
    since = holder.get("started")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(float(since)))
        if isinstance(since, (int, float))
        else ""
    )
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}{when}"
    way_out = (
        "wait for it to end (or stop it), or use another run.name"
        if locks
        else f"this filesystem has no locks: if that process is gone, delete {path}; else wait "
        "for it, or use another run.name"
    )
    return f"run {run_dir} is in use by another start of it ({who}): {way_out}"
