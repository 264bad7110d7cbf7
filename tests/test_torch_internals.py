"""The private torch names runner reaches live in `runner/torch_internals.py` only, and each of them is
there in the installed torch, with the arguments runner passes: a torch release that moves one fails here,
not in a user's launch (CI runs it on torch 2.13 and, in .ci/tpu.sh's venv, on 2.9, the floor)."""

from __future__ import annotations

import ast
import inspect
import re
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, PContext
from torch.distributed.launcher import api as launcher_api
from torch.multiprocessing.spawn import ProcessContext

from runner import torch_internals
from runner.torch_internals import ElasticAgent

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "runner" / "torch_internals.py"
TORCH_DIR = Path(torch.__file__).parent

# Private attributes runner reads of other libraries than torch, where torch has a name alike.
NOT_TORCH = {
    ("runner/errors.py", "_metadata"): "an OmegaConf node's",
    ("runner/checkpoint/accelerate_layout.py", "_reconstruct"): "numpy's, which torch's weights-only reader allows",
    ("runner/accelerate/utils.py", "_get_device_type"): "Habana's",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@cache
def torch_private_names() -> frozenset[str]:
    """The private names torch's Python code defines: its functions, classes and instance attributes."""
    found: set[str] = set()
    definition = re.compile(r"(?:\bdef |\bclass |\bself\.)(_[A-Za-z]\w*)")
    for path in TORCH_DIR.rglob("*.py"):
        found.update(definition.findall(path.read_text(errors="ignore")))
    return frozenset(found)


def runner_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name runner's own code defines or assigns (its private attributes are its own)."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def private_torch_uses(path: Path, tree: ast.Module, own: set[str]) -> list[str]:
    """`path`'s imports of private torch modules or names, and the private attributes it reads that
    runner does not define and torch does."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                name = f"{module}.{alias.name}" if module else alias.name
                if name.split(".")[0] == "torch" and any(is_private(p) for p in name.split(".")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
        elif (
            isinstance(node, ast.Attribute)
            and is_private(node.attr)
            and node.attr not in own
            and node.attr in torch_private_names()
            and (str(path.relative_to(ROOT)), node.attr) not in NOT_TORCH
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_but_the_shim_reaches_a_private_torch_name():
    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "runner").rglob("*.py"))}
    own = runner_names({p: t for p, t in trees.items() if p != SHIM}) - {
        # what the shim's agent overrides or reads of torch's, which is no definition of runner's elsewhere
        name for name, _ in inspect.getmembers(ElasticAgent) if is_private(name)
    }
    found = [use for path, tree in trees.items() if path != SHIM for use in private_torch_uses(path, tree, own)]
    assert found == [], "reach torch's private names through runner/torch_internals.py only"
    assert private_torch_uses(SHIM, trees[SHIM], set()) != [], "the scan finds what the shim reaches"


def test_the_elastic_agents_private_steps_are_there_with_the_arguments_the_shim_passes():
    for step in ("_start_workers", "_monitor_workers", "_restart_workers"):
        method = getattr(LocalElasticAgent, step)
        assert list(inspect.signature(method).parameters) == ["self", "worker_group"], step
    sources = inspect.getsource(LocalElasticAgent) + inspect.getsource(SimpleElasticAgent)
    assert "self._pcontext" in sources
    invoke_run = inspect.getsource(SimpleElasticAgent._invoke_run)
    # a failed group restarts while `_remaining_restarts` is left, counted down before `_restart_workers`
    assert "self._remaining_restarts > 0" in invoke_run
    assert invoke_run.index("self._remaining_restarts -= 1") < invoke_run.index("self._restart_workers(")
    assert "self._pc" in inspect.getsource(MultiprocessContext)
    assert "grace_period" in inspect.signature(ProcessContext.join).parameters
    assert "timeout" in inspect.signature(PContext.close).parameters
    # elastic_launch builds the agent by the module global that `launching_with` replaces
    assert re.search(r"\bagent = LocalElasticAgent\(", inspect.getsource(launcher_api.launch_agent))
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_the_other_private_names_are_there():
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = torch.compile(torch.nn.Linear(2, 2))
    assert isinstance(compiled, OptimizedModule) and isinstance(compiled._orig_mod, torch.nn.Linear)
    assert torch_internals.compiled_module(compiled) is compiled._orig_mod
    assert torch_internals.compiled_module(torch.nn.Linear(2, 2)) is None
    assert {"default", "reduce-overhead", "max-autotune"} <= set(torch_internals.inductor_modes())
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(record)
    assert "filename" in inspect.signature(torch.cuda.memory._dump_snapshot).parameters
    assert list(inspect.signature(DeviceMesh._flatten).parameters)[:2] == ["self", "mesh_dim_name"]
    weight = torch.ones(4, 4)
    assert torch_internals.view_base(weight[1:]) is weight and torch_internals.view_base(weight) is None


def test_the_functional_collectives_gather_with_a_gradient_and_sum(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        share = torch.arange(6.0).view(1, 2, 3).requires_grad_()
        whole = torch_internals.gathered_along(share, 2, dist.group.WORLD)
        assert torch.equal(whole, share.detach())
        (whole * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        assert torch.equal(share.grad, torch.tensor([1.0, 2.0, 3.0]).expand(1, 2, 3))
        assert torch_internals.summed(torch.tensor(2.5), dist.group.WORLD).item() == 2.5
    finally:
        dist.destroy_process_group()
