"""No import cycles where the package was split to remove them (a static walk of every import statement).

The kv-transfer connectors, the global scheduler and the flag-parsing chain (arg_utils -> cli_args ->
argparse_utils) each had one.

Every ``import``/``from ... import`` in ``fastdeploy/`` counts, lazy ones inside functions too (a lazy
import is still a cycle, only a hidden one); imports under ``if TYPE_CHECKING:`` do not (they never run).
``from package import name`` points at ``package.name`` when that is a module, else at the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fastdeploy"


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    files = _module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_walker_sees_imports_and_cycles() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "fastdeploy.distributed.kv_transfer.shm_transport" in graph["fastdeploy.distributed.kv_transfer.zmq_connector"]
    # A lazy import inside a function counts (engine/core.py imports pd_engine in a method).
    assert "fastdeploy.distributed.kv_transfer.pd_engine" in graph["fastdeploy.engine.core"]


@pytest.mark.parametrize("package", ["fastdeploy.distributed", "fastdeploy.engine.global_scheduler",
                                     "fastdeploy.engine.arg_utils", "fastdeploy.engine.cli_args",
                                     "fastdeploy.utils.argparse_utils"])
def test_no_module_imports_one_that_imports_it_back(package: str) -> None:
    cycles = [c for c in import_cycles(import_graph()) if any(m == package or m.startswith(package + ".") for m in c)]
    assert cycles == []


def test_transports_depend_only_on_the_interface() -> None:
    graph = import_graph()
    kv = "fastdeploy.distributed.kv_transfer"
    for transport in ("tcp_transport", "shm_transport"):
        assert graph[f"{kv}.{transport}"] <= {f"{kv}.base", f"{kv}.topology"}
    assert graph[f"{kv}.base"] <= {f"{kv}.topology"}


def test_public_names_stay_where_vllm_users_look():
    from fastdeploy import AsyncEngineArgs as TopAsync
    from fastdeploy import EngineArgs as TopEngineArgs
    from fastdeploy.engine.arg_utils import AsyncEngineArgs, EngineArgs, parse_json, parse_size
    from fastdeploy.entrypoints.openai.cli_args import make_arg_parser
    from fastdeploy.utils.argparse_utils import FlexibleArgumentParser

    assert TopEngineArgs is EngineArgs and TopAsync is AsyncEngineArgs
    assert parse_size("1K") == 1024 and parse_json('{"a": 1}') == {"a": 1}
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--max-model-len", "1k"])
    assert EngineArgs.from_cli_args(args).max_model_len == 1000
