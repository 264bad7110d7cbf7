"""The package's layers go one way: a module imports only from its own layer or the ones below, at module
level (no function-level import of runner code, the way cycles hide), and the imports form no cycle."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import runner

ROOT = Path(__file__).resolve().parents[1]

# The Accelerate-compatible surface is an adapter over the core: nothing outside it imports it, but the
# facade (which also gives Accelerate's module names, `runner.PORTING_NAMES`, to runner's modules).
ADAPTER = "runner.accelerate"

# Lowest first. A module belongs to the first layer one of whose prefixes names it or its package.
LAYERS: list[tuple[str, list[str]]] = [
    ("the files a run writes", ["runner.files"]),
    (
        "state, files and components",
        [
            "runner.errors",
            "runner.ops",
            "runner.state",
            "runner.cluster",
            "runner.run_dir",
            "runner.telemetry",
            "runner.config",
            "runner.perf",
            "runner.rng",
            "runner.checkpoint.files",
            "runner.checkpoint.weights",
            "runner.hardware.big_modeling",
            "runner.schedulers",
            "runner.models",
            "runner.data",
            "runner.task",
            "runner.tasks",
            "runner.torch_internals",
        ],
    ),
    ("precision", ["runner.precision"]),
    ("hardware strategies", ["runner.hardware"]),
    (
        "the Accelerator and its wrappers",
        [
            "runner.engine",
            "runner.checkpoint",
            "runner.trackers",
        ],
    ),
    ("the Accelerate adapter", ["runner.accelerate"]),
    ("building from config", ["runner.build", "runner.validate"]),
    (
        "loops and the plan",
        ["runner.callbacks", "runner.train", "runner.evaluation", "runner.inference", "runner.plan", "runner.export"],
    ),
    ("launchers", ["runner.launchers"]),
    (
        "entry points",
        [
            "runner.cli",
            "runner.compose",
            "runner.env",
            "runner.group_schemas",
            "runner.schemas",
            "runner.sweep",
            "runner.__main__",
        ],
    ),
]
# The package's public face re-exports from every layer; nothing inside the package imports it.
FACADE = "runner"


# Installed package -> its folder in the repository, where they differ (pyproject.toml's package-dir).
PACKAGE_DIRS = {"runner.tasks": "tasks"}


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package, folder in PACKAGE_DIRS.items():
        if name == folder or name.startswith(folder + "."):
            return package + name.removeprefix(folder)
    return name


def source_path(module: str) -> Path:
    """Where `module` (a package or a module) lives in the repository, without the suffix."""
    for package, folder in PACKAGE_DIRS.items():
        if module == package or module.startswith(package + "."):
            module = folder + module.removeprefix(package)
    return ROOT / Path(*module.split("."))


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")


def internal_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, imported at module level) for each import of runner code in `path`."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "runner":
                found.append((resolve(name), id(node) in top_level))
    return found


def resolve(name: str) -> str:
    """`runner.hardware.DDP` -> `runner.hardware` (the module of an imported name)."""
    while name and not (source_path(name).is_dir() or source_path(name).with_suffix(".py").is_file()):
        name = name.rpartition(".")[0]
    return name


STARTER = ROOT / "runner" / "cli" / "starter"  # the project `runner init` writes: a user's code, not runner's
SOURCES = sorted(
    path
    for path in [*ROOT.glob("runner/**/*.py"), *ROOT.glob("tasks/**/*.py")]
    if not path.is_relative_to(STARTER)
)
GRAPH = {module_name(path): internal_imports(path) for path in SOURCES}


def violations(module: str, imports: list[tuple[str, bool]]) -> list[str]:
    """What breaks the rules in `module`'s imports."""
    found = []
    for imported, at_module_level in imports:
        if imported == FACADE:
            found.append(f"{module} imports the `runner` package itself: import the module it means")
        elif not at_module_level:
            found.append(f"{module} imports {imported} inside a function: import it at the top")
        elif layer_of(imported) > layer_of(module):
            found.append(
                f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported}, a higher layer "
                f"({LAYERS[layer_of(imported)][0]})"
            )
    return found


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `edges` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(edges.get(module, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_every_module_is_in_a_layer():
    for module in GRAPH:
        if module != FACADE:
            layer_of(module)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != FACADE))
def test_imports_go_down_only_and_at_module_level(module):
    assert violations(module, GRAPH[module]) == []


def test_no_import_cycles():
    edges = {m: {i for i, _ in imports if i != m and i in GRAPH} for m, imports in GRAPH.items()}
    assert find_cycle(edges) is None


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def adapter_importers(graph: dict[str, list[tuple[str, bool]]]) -> list[str]:
    """The modules of `graph` outside the adapter (and its porting names) that import from it."""
    return sorted(
        module
        for module, imports in graph.items()
        if module != FACADE and not in_package(module, ADAPTER)
        if any(in_package(imported, ADAPTER) for imported, _ in imports)
    )


def test_the_core_does_not_import_the_accelerate_adapter():
    assert adapter_importers(GRAPH) == []


def test_accelerates_module_names_are_runners_modules():
    """`from runner.utils import set_seed` in a ported script reaches the adapter's own module object; a
    module runner does not have is still a ModuleNotFoundError."""
    for name, target in runner.PORTING_NAMES.items():
        assert importlib.import_module(name) is importlib.import_module(target), name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("runner.nope")


MAX_FUNCTION_LINES = 60


def long_functions(source: str, where: str) -> list[str]:
    """`where:name (lines)` for each function of `source` longer than MAX_FUNCTION_LINES, its signature,
    docstring and nested functions counted in."""
    return [
        f"{where}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_of_the_package_is_longer_than_60_lines():
    """One screen a function: a longer one does several things, each of which can have its name."""
    found = [
        f
        for path in sorted((ROOT / "runner").rglob("*.py"))
        for f in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_a_long_function_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"def short():\n    return 1\n\n\ndef long():\n{body}"
    assert long_functions(source, "probe.py") == [f"probe.py:long ({MAX_FUNCTION_LINES + 1})"]


def test_the_checks_can_fail():
    """A strategy importing the loop, a lazy import and an import of the facade are flagged; a cycle is found;
    the loop importing the adapter is found."""
    assert violations("runner.hardware.base", [("runner.train", True)])
    assert adapter_importers({"runner.train": [("runner.accelerate.utils", True)]}) == ["runner.train"]
    assert violations("runner.train", [("runner.ops", False)])
    assert violations("runner.ops", [("runner", True)])
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_facade_imports_a_module_only_when_one_of_its_names_is_used():
    """`import runner` costs nothing (the tracker's sender imports runner code, never torch); every public
    name resolves to the object of the module `EXPORTS` names."""
    code = (
        "import sys, importlib, runner\n"
        "import runner.trackers.upload\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert sorted(runner.__all__) == sorted(runner.EXPORTS)\n"
        "for name, module in runner.EXPORTS.items():\n"
        "    assert getattr(runner, name) is getattr(importlib.import_module(module), name), name\n"
        "from runner import *\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_command_imports_no_clusters_client_until_it_launches_there():
    """`python -m runner`'s own modules import neither Ray nor the Kubernetes packages (Ray Train's import
    alone took 2 s of every command, and pulled pandas and pyarrow in): a launcher imports its cluster's
    client when it checks or launches a job there."""
    code = (
        "import sys, runner.cli\n"
        "heavy = [m for m in ('ray', 'kubernetes', 'kubeflow_trainer_api', 'submitit', 'pandas') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_the_slurm_environment_reads_slurms_variables():
    """`runner/cluster/slurm.py` (SLURM's `ClusterEnvironment`) is the one place that reads SLURM's variables."""
    readers = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "runner").rglob("*.py")
        if path != ROOT / "runner" / "cluster" / "slurm.py" and "SLURM_" in path.read_text()
    )
    assert readers == []
