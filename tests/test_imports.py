"""The package's import graph: no cycles (every import, lazy ones in functions too), the
error classes at its bottom, the core never naming a dataset format or a model, and
torch left out of what a Ray Data read task and a config error import."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "elastic"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The elastic modules ``path`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in ``graph`` as a path (first and last the same), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_and_errors_at_the_bottom():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    assert graph["elastic.errors"] == set()


def test_the_core_names_no_format_no_model_and_no_task():
    """Formats, models and tasks are registered (elastic.data.formats, elastic.models,
    elastic.tasks): the layers that use them never import a dataset module, a model
    family or a task; only the registries and the typed bases."""
    modules = _modules()
    layers = (["config"], ["data"], ["train"], ["observe"])
    core = [m for m in modules if m.split(".")[1:2] in layers]
    for m in core:
        plugins = {
            d
            for d in _imports(modules[m], modules)
            if d.startswith(("elastic.datasets.", "elastic.models.", "elastic.tasks."))
            and d not in ("elastic.models.base", "elastic.tasks.base")
        }
        # the synthetic generator is the driver's, for missing synthetic data
        plugins.discard("elastic.datasets.synthetic")
        assert not plugins, f"{m} imports {sorted(plugins)}"


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_product_imports_no_benchmark_and_no_test_harness():
    """Benchmarks (elastic_bench) and the local-cluster harness (elastic_harness) live
    beside the product: no module of elastic imports either, wherever the import is."""
    tooling = ("elastic_bench", "elastic_harness")
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad = [n for n in names if n.split(".")[0] in tooling]
            assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}"


def test_packages_import_each_other_in_one_direction():
    """Between the packages of elastic (config, data, train, ...) the imports go one way:
    no package imports another that imports it back, through any chain. config composes
    the sections data and observe define; train runs on cluster; nothing imports train."""
    modules = _modules()

    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for m, path in modules.items():
        graph.setdefault(package(m), set()).update(
            package(d) for d in _imports(path, modules) if package(d) != package(m)
        )
    cycle = _cycle(graph)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle or [])
    assert not any("elastic.train" in deps for p, deps in graph.items() if p != "elastic.train")


READ_TASK = """
import sys
import pyarrow.parquet as pq
from elastic.data.formats import FORMATS
from elastic.data.pipeline import decoder
from elastic.plugins import BUILTIN, load_plugins
from elastic.data.settings import DataConfig

shard = sys.argv[1]
decode, kwargs = decoder(DataConfig(path=sys.argv[2]), shard)
out = decode(pq.ParquetFile(shard).read_row_group(0), **kwargs)
assert len(out["y"]) > 0, out
load_plugins()  # a plugin-format's read task imports every built-in format's module
assert all(m in sys.modules for m in BUILTIN) and len(FORMATS) > len(BUILTIN), sorted(FORMATS)
print("torch" in sys.modules)
"""


CONFIG_ERROR = """
import runpy, sys
entry = sys.argv[1]
sys.argv = ["run.py", "+experiment=smoke", "+model.chanels=3"]
try:
    runpy.run_path(entry, run_name="__main__")
except SystemExit as e:
    print(e.code, "torch" in sys.modules)
"""


def test_a_config_error_on_the_command_line_imports_no_torch():
    """A typo in a key or value ends the command in one line before Ray starts; it did
    so after importing torch (seconds: the model families' configs imported their
    networks). The configs read no torch now (networks: elastic/models/nets/)."""
    import subprocess
    import sys

    run_py = str(PACKAGE.parent / "launch" / "run.py")
    out = subprocess.run(
        [sys.executable, "-c", CONFIG_ERROR, run_py], capture_output=True, text=True, timeout=120
    )
    assert "unknown config key model.chanels" in out.stderr, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "2 False", out.stdout[-2000:]


def test_a_read_task_imports_no_torch(small_data):
    """What a Ray Data read task imports (the pipeline, the format registry with every
    built-in format, a real shard's decoder and its decoding) leaves torch out: it costs
    a read process seconds of CPU that a worker group's start waits for, and decoding
    never needs it (models and their torch are the training worker's)."""
    import subprocess
    import sys

    shard = sorted((small_data / "train").glob("*.parquet"))[0]
    out = subprocess.run(
        [sys.executable, "-c", READ_TASK, str(shard), str(small_data / "train")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False", "a read task imported torch"


UNPICKLE = """
import sys
from ray import cloudpickle
cloudpickle.loads(sys.stdin.buffer.read())
print("torch" in sys.modules)
"""


def test_what_ray_trains_controller_unpickles_imports_no_torch(small_data):
    """Ray Train's controller process unpickles the training function, its config (the
    run's WorkerArgs: a real experiment's TrainConfig) and the process-group config as it
    starts, before it asks for any worker; it imported torch there (~2.4 CPU s of every
    run's start, on the way to its first worker). elastic.train.entry and
    elastic.cluster.rendezvous import no torch."""
    import subprocess
    import sys

    from ray import cloudpickle

    from elastic.cluster.rendezvous import ProcessGroupConfig
    from elastic.config.compose import compose, typed_config
    from elastic.data.order import Layout
    from elastic.train.entry import train_loop
    from elastic.train.worker_args import WorkerArgs

    overrides = ["+experiment=smoke", f"data.path={small_data}/train", "data.val_path=null"]
    cfg = typed_config(
        compose([*overrides, "model.input_dim=32", "model.output_dim=4"])[0], "smoke"
    )
    args = WorkerArgs(cfg, {}, "/nowhere", ["a.parquet"], Layout(((4,),)), {}, False, 4)
    payload = cloudpickle.dumps(
        (train_loop, {"args": args}, ProcessGroupConfig(backend="gloo", loopback=True))
    )
    out = subprocess.run(
        [sys.executable, "-c", UNPICKLE], input=payload, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().split() == ["False"], "the controller's objects import torch"
