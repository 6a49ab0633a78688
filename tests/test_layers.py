"""The package's layers (docs/architecture.md): which subpackage of hf_acco may import which, read from the source
of every module (relative imports resolved), so that no arrow points upward; and the public entry points."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_acco"
HUGGING_FACE = {"transformers", "accelerate", "datasets", "peft", "trl", "evaluate"}

# Each layer and the layers of hf_acco it may import (its own included); bottom first.
MAY_IMPORT = {
    "comm": {"comm"},
    "engine": {"comm", "engine"},
    "pacing": {"comm", "engine", "pacing"},
    "integrations": {"comm", "engine", "pacing", "integrations"},
    "tools": {"comm", "engine", "pacing", "integrations", "tools", "tasks"},
    "tasks": {"tasks"},
}
TORCH_ONLY = {"comm", "engine", "pacing"}  # no Hugging Face library, not even lazily inside a function


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Every module ``path`` imports (its text, or ``source``), anywhere in it, with relative imports made absolute."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # ``from hf_acco import engine``
    return found


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hf_acco" and parts[1] in MAY_IMPORT else None


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_of_the_package_is_in_a_layer_or_is_a_public_entry_point() -> None:
    top_level = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top_level == ["__init__.py", "bench.py", "checkpoint.py", "demo.py", "memory.py", "plan.py", "trl.py"]
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name[0] != ".")
    assert folders == sorted(MAY_IMPORT)


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_no_import_points_upward(layer: str) -> None:
    wrong = []
    for path in _modules():
        if _layer_of(".".join(path.relative_to(ROOT).parts)) != layer:
            continue
        for name in _imports(path):
            target = _layer_of(name)
            if name == "hf_acco" or (name.startswith("hf_acco.") and target is None):
                wrong.append(f"{path.relative_to(ROOT)} imports {name} (the public API: import from a layer)")
            elif target is not None and target not in MAY_IMPORT[layer]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            elif layer in TORCH_ONLY and name.split(".")[0] in HUGGING_FACE:
                wrong.append(f"{path.relative_to(ROOT)} imports {name} (this layer imports only torch)")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_relative_import_upward() -> None:
    """The checker itself: a relative import from comm/ into engine/ is an arrow upward (a module that is not
    written anywhere: its source is given)."""
    found = _imports(PACKAGE / "comm" / "probe.py", "from ..engine import core\nfrom . import quant\n")
    assert {"hf_acco.engine.core", "hf_acco.comm.quant"} <= found
    assert _layer_of("hf_acco.engine.core") not in MAY_IMPORT["comm"]


def test_no_module_is_longer_than_450_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


@pytest.mark.parametrize(
    "command",
    [["hf_acco.plan", "--help"], ["hf_acco.memory", "--help"], ["hf_acco.bench", "--help"],
     ["hf_acco.checkpoint", "--help"], ["hf_acco.demo", "--help"]],
    ids=lambda c: c[0],
)  # fmt: skip
def test_the_public_commands_start(command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: python -m " + command[0] in done.stdout


# maintainers' tools and the test harness set up and measure process groups themselves, beside the training path
OWN_PROCESS_GROUPS = ("hf_acco/tools/",)


SUBMODULES = ("tensor", "fsdp", "device_mesh")  # FSDP2's API: not torch.distributed's collectives


def _distributed_calls(path: Path, base: Path = ROOT) -> list[str]:
    """Each call of a torch.distributed function (``dist.barrier()``, ``torch.distributed.all_reduce(...)``, a function
    imported from it) in ``path``, as "line: the call"; its types (``dist.ProcessGroup``) and submodules (FSDP2's
    ``fully_shard``, ``DTensor``) are not calls of it."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, functions = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            functions.update(a.asname or a.name for a in node.names if a.name[0].islower())

    def root(func: ast.expr) -> str:
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        return ".".join([func.id, *reversed(parts)]) if isinstance(func, ast.Name) else ""

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = root(node.func)
            prefix = next((a for a in aliases if name.startswith(a + ".")), None)
            submodule = prefix is not None and name[len(prefix) + 1 :].split(".")[0] in (
                "tensor",
                "fsdp",
                "device_mesh",
            )
            if (prefix is not None and not submodule) or name in functions:
                found.append(f"{path.relative_to(base)}:{node.lineno}: {name}()")
    return found


def test_every_torch_distributed_call_goes_through_comm() -> None:
    """Collectives, groups and stores are called in ``hf_acco/comm/`` only: the place a changing membership (a
    process group that is rebuilt, torchft's) attaches to."""
    calls = [
        call
        for path in _modules()
        if not str(path.relative_to(ROOT)).startswith(("hf_acco/comm/", *OWN_PROCESS_GROUPS))
        for call in _distributed_calls(path)
    ]
    assert not calls, "\n".join(calls)


def test_the_check_sees_a_distributed_call(tmp_path: Path) -> None:
    source = "import torch.distributed as dist\nfrom torch.distributed import barrier\nx: dist.Store\n"
    source += "dist.all_reduce(t)\nbarrier()\ndist.tensor.DTensor\n"
    (tmp_path / "m.py").write_text(source)
    assert _distributed_calls(tmp_path / "m.py", tmp_path) == ["m.py:4: dist.all_reduce()", "m.py:5: barrier()"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere (lazily inside a function, or for the type checker
    only, included). ``from package import module`` is an edge to the module, not to the package's ``__init__``."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    if target in paths:
                        edges.add(target)
        graph[name] = edges - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package() -> None:
    """No module of hf_acco imports, through any chain (lazy and type-checking imports included), one that imports
    it back: each part can be read, tested and replaced on its own (the Trainer parts share ``run_state.py``)."""
    assert _circles(_import_graph()) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
