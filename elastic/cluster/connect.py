"""Connect to Ray: an embedded local cluster by default, or an explicit head address.

Never ``address="auto"``: on a shared node it can attach to somebody else's cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # launch/run.py imports this module first thing: keep it light
    from elastic.cluster.settings import ClusterConfig, ScalingConfig

# Settings every worker process needs, whatever node it lands on.
WORKER_ENV = {
    # DeepSpeed picks its accelerator at import; without a GPU say so (it warns otherwise)
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
    # Ray Train tees print() into its logger too, which doubles every console line
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}
LOOPBACK = "127.0.0.1"
USAGE_STATS = "RAY_USAGE_STATS_ENABLED"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
"""A batch system's warning (SIGTERM, SIGUSR1) and a closed terminal or ssh session
(SIGHUP, whose default would kill the driver at once and leave its Ray behind)."""
PREEMPTED = 75  # exit code after a stop signal (EX_TEMPFAIL): the same command resumes


# ---------------------------------------------------------------- stop signals
class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGUSR1) outside the checkpoint-and-stop of fit(): the run
    unwinds, shutting Ray down on the way, and ends with exit 75. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_pending: list[int] = []  # stop signals that arrived while Ray was starting or stopping
_deferring = 0


def _on_stop_signal(signum: int, _frame: Any) -> None:
    if signum == signal.SIGHUP:
        off_the_terminal()
    if _deferring:
        _pending.append(signum)
        return
    raise Stopped(signum)


def stop_signals() -> tuple[int, ...]:
    """The stop signals this process acts on: SIGHUP only where it is not ignored (a run
    started with ``nohup`` goes on when its terminal closes)."""
    ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and ignored))


def handle_stop_signals() -> None:
    """From now on a stop signal raises :class:`Stopped` (the default action would kill
    the process and leave its Ray cluster's processes running)."""
    for s in stop_signals():
        signal.signal(s, _on_stop_signal)


def off_the_terminal() -> None:
    """After a hang-up: standard output and error that went to the closed terminal go
    to /dev/null instead (a write there fails, and would end what is stopping the run
    cleanly; the run's records are in its files)."""
    devnull = None
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                devnull = devnull if devnull is not None else os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
    if devnull is not None:
        os.close(devnull)


@contextmanager
def exit_on_stop() -> Iterator[None]:
    """The entry point's end on :class:`Stopped`: one line, exit 75."""
    try:
        yield
    except Stopped as e:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)  # stopping already: a repeat changes nothing
        with contextlib.suppress(OSError):  # a terminal gone
            print(
                f"[elastic] {e}: stopped; the last complete checkpoint (if any) is kept: run "
                "the same command (same run.name) to resume",
                file=sys.stderr,
                flush=True,
            )
        sys.exit(PREEMPTED)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ray's start and shutdown are not cut in half by a stop signal (a half-started
    cluster leaves processes behind): the signal is raised when the block is done."""
    global _deferring
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    _deferring += 1
    try:
        yield
    except SystemExit as e:
        # ray.init() installs its own SIGTERM handler, sys.exit(SIGTERM), for as long
        # as it runs
        if e.code != signal.SIGTERM:
            raise
        _pending.append(signal.SIGTERM)
    finally:
        _deferring -= 1
        if handler is not None and signal.getsignal(signal.SIGTERM) is not handler:
            signal.signal(signal.SIGTERM, handler)  # ray.init() left its own
    if _pending and not _deferring:
        raise Stopped(_pending.pop(0))


# ---------------------------------------------------------------- Ray
def local_cpus(cluster: ClusterConfig, scaling: ScalingConfig) -> int:
    """Logical CPUs of the embedded cluster: all of this machine's, and at least enough
    for the widest worker group plus two for Ray Data's read and decode tasks (which
    would otherwise wait forever behind the training workers on a small machine)."""
    if cluster.num_cpus is not None:
        return cluster.num_cpus
    needed = int(scaling.max_workers * scaling.cpus_per_worker + 0.999) + 2
    return max(os.cpu_count() or 1, needed)


@contextmanager
def connect(cluster: ClusterConfig, scaling: ScalingConfig) -> Iterator[str]:
    """Start or join Ray for the duration of the block; yields a description of it.

    A stop signal at any moment of it (start-up and shutdown included) shuts Ray down
    and raises :class:`Stopped`; an embedded cluster leaves nothing running behind."""
    import ray

    if ray.is_initialized():
        # a notebook or test session that already started Ray: use it, leave it running
        yield "the Ray session already running in this process"
        return
    from elastic.cluster.allocator import worker_malloc_env

    env = {**WORKER_ENV, **worker_malloc_env(os.environ)}
    if scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cuda"
    # a user's formats and models (README "Bring your own dataset, model or task") must import
    # on every worker, on any node, as on the driver
    for key in ("ELASTIC_PLUGINS", "PYTHONPATH"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    # Ray's usage statistics go to Anyscale over the internet, which compute nodes rarely
    # reach, and Ray Data records them through an actor process of their own: off
    # unless the user turned them on (RAY_USAGE_STATS_ENABLED=1)
    os.environ.setdefault(USAGE_STATS, "0")
    env[USAGE_STATS] = os.environ[USAGE_STATS]
    if cluster.address:  # a stop signal ends this wait (Ray's start defers it)
        wait_for_head(cluster.address, cluster.connect_timeout_s)
    with contextlib.ExitStack() as stack:
        try:
            with _signals_deferred():
                if cluster.address:
                    ray.init(
                        address=cluster.address,
                        runtime_env={"env_vars": env},
                        log_to_driver=True,
                    )
                    where = f"Ray cluster at {cluster.address}"
                else:
                    temp_dir = stack.enter_context(_embedded_session())
                    _start_embedded(cluster, scaling, env, temp_dir)
                    where = "embedded local Ray cluster"
            fresh_node_view(scaling.node_refresh_s)
            yield where
        finally:
            with _signals_deferred():
                ray.shutdown()


def wait_for_head(address: str, timeout_s: float) -> None:
    """Until the head at ``address`` (``HOST:PORT``) takes a TCP connection, at most
    ``timeout_s``: then a ConfigError naming it (``ray.init`` would retry for minutes
    without a word)."""
    import socket
    import time

    from elastic.cluster.settings import host_port
    from elastic.errors import ConfigError

    found = host_port(address)
    if found is None:
        return  # the config check refuses it; nothing to probe
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(found, timeout=min(5.0, timeout_s)).close()
            return
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"cluster.address={address}: nothing answers there ({why}) after "
                    f"{timeout_s:g} s: check the head's address and that its Ray runs (a "
                    "batch job's is in jobs/JOBID/), or raise cluster.connect_timeout_s"
                ) from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _start_embedded(
    cluster: ClusterConfig, scaling: ScalingConfig, env: dict[str, str], temp_dir: str
) -> None:
    """A one-machine Ray whose every process listens on loopback only."""
    import ray

    from elastic.cluster.bootstrap import WORKER_POOL, quiet_log_monitor
    from elastic.cluster.ray_internals import fast_worker_start, ray_constants

    constants = ray_constants()
    fast_worker_start()
    interface = _loopback_interface()
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface  # gloo's pair sockets: loopback too
    # Ctrl-C in a terminal, and the terminal's hang-up, signal the whole foreground
    # process group, and the embedded cluster's processes are our children in it: they
    # would die before Ray Train could stop the run gracefully. They inherit ignored
    # SIGINT and SIGHUP.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGHUP)}
        if main_thread
        else {}
    )
    # Ray turns a loopback node address into the machine's external one, except where it
    # believes it can only run alone (macOS, Windows): so it binds every server there.
    clusters = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    quiet_log_monitor()
    try:
        ray.init(
            address="local",
            _node_ip_address=LOOPBACK,
            _temp_dir=temp_dir,
            num_cpus=local_cpus(cluster, scaling),
            object_store_memory=cluster.object_store_memory_mb * 1024 * 1024,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
            _system_config=WORKER_POOL,
        )
    finally:
        constants.ENABLE_RAY_CLUSTER = clusters
        for s, handler in previous.items():
            signal.signal(s, handler)


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == LOOPBACK for a in addrs):
            return name
    return None


# ---------------------------------------------------------------- the embedded cluster's files
SESSION_PREFIX = "elastic-ray-"


def _sessions_root() -> Path:
    """Short: Ray's unix socket paths under it must stay within ~107 bytes."""
    base = os.environ.get("TMPDIR") or "/tmp"
    return Path(base if len(base) <= 20 and os.path.isdir(base) else "/tmp")


@contextmanager
def _embedded_session() -> Iterator[str]:
    """This run's own directory for the embedded cluster: Ray's temp dir (sessions,
    logs, sockets, spilled objects) and a fresh 0600 token, instead of /tmp/ray (never
    cleaned) and ~/.ray/auth_token (0644, shared by every local run). Removed at the end
    with whatever of the cluster is still running; the directories of our runs that
    were killed (-9) are removed at the next start.

    The run holds a lock on its directory while it lives: a directory whose lock can be
    taken belongs to a dead run, the proof the sweep needs."""
    import psutil

    from elastic.cluster.bootstrap import become_subreaper, stop_processes, write_token

    root = _sessions_root()
    _sweep_dead_sessions(root)
    path = root / f"{SESSION_PREFIX}{os.getpid()}"
    building = root / f".{SESSION_PREFIX}{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)  # a dead run's that had our pid
    building.mkdir(mode=0o700)
    lock = os.open(building, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    building.rename(path)  # the sweep only looks at locked-before-named directories
    token = path / "token"
    write_token(token)
    saved = {
        k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")
    }
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    _reload_ray_token()
    # processes that the cluster's processes leave behind when they exit come to us (not
    # to init), so the teardown finds every one
    become_subreaper()
    others = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        yield str(path / "ray")
    finally:
        with _signals_deferred():
            stop_processes(
                lambda: [
                    p for p in psutil.Process().children(recursive=True) if p.pid not in others
                ],
                grace_s=3.0,
            )
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _reload_ray_token()
            shutil.rmtree(path, ignore_errors=True)
            os.close(lock)


def _reload_ray_token() -> None:
    """Ray caches its auth mode and token per process: make it read the environment."""
    from elastic.cluster.ray_internals import reload_auth_token

    with contextlib.suppress(Exception):  # Ray moved on: it reads them at start then
        reload_auth_token()


def _sweep_dead_sessions(root: Path) -> None:
    """Remove the embedded-cluster directories of our runs that died without cleaning
    up (kill -9), and stop what of their clusters still runs (Ray's agents outlive a
    killed raylet by a minute or more): processes of ours holding files there."""
    import psutil

    from elastic.cluster.bootstrap import stop_processes

    uid = os.getuid()
    for path in root.glob(f"{SESSION_PREFIX}*"):
        try:
            if path.is_symlink() or path.stat().st_uid != uid:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live run's
        prefix = f"{path}/"

        def leftovers(prefix: str = prefix) -> list[psutil.Process]:
            found = []
            for p in psutil.process_iter(["uids"]):
                with contextlib.suppress(psutil.Error):
                    if p.info["uids"].real == uid and any(
                        f.path.startswith(prefix) for f in p.open_files()
                    ):
                        found.append(p)
            return found

        stop_processes(leftovers, grace_s=3.0)
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def fresh_node_view(interval_s: float) -> None:
    """Make Ray Train's elastic policy see node deaths and arrivals within ``interval_s``.

    Ray Train 2.60 sizes an elastic worker group from the resources Ray Data's
    cluster-wide ``AutoscalingCoordinator`` actor reserves, and that actor refreshes its
    view of the nodes every 20 s: a dead node looks alive for up to 20 s (the restart
    asks for it and waits out ``scaling.start_timeout_s``) and a new node is noticed up
    to 20 s late. We create that (detached, named) actor first, with a shorter refresh.
    If it already exists (another job on a long-lived cluster made it), it is left as
    it is."""
    import ray

    from elastic.cluster.ray_internals import autoscaling_coordinator

    dac = autoscaling_coordinator()

    base = dac._AutoscalingCoordinatorActor
    if not isinstance(getattr(base, "TICK_INTERVAL_S", None), (int, float)):
        return  # Ray moved on: nothing to tune
    fast = type("FastRefreshAutoscalingCoordinator", (base,), {"TICK_INTERVAL_S": interval_s})
    ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(fast).options(
        name="AutoscalingCoordinator",
        namespace="AutoscalingCoordinator",
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=dac.NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote()
