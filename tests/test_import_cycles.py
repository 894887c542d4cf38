"""No module of the flag-parsing chain imports one that imports it back.

The graph is read from the source with ``ast`` (every ``import`` / ``from ... import``,
function-local ones included, since a lazy import is still a cycle a reader must
untangle), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fastdeploy"


def _module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str) -> set[str]:
    """The fastdeploy modules ``module`` imports anywhere in its body (``from x import y`` counts y if a module)."""
    path = _module_path(module)
    if path is None:
        return set()
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            # ``from fastdeploy.engine import arg_utils`` imports the submodule.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] == PACKAGE and _module_path(m) is not None}


def _reaches(start: str, goal: str) -> list[str] | None:
    """An import path start -> ... -> goal, or None."""
    stack, seen = [(start, [start])], {start}
    while stack:
        module, path = stack.pop()
        for nxt in _imports(module):
            if nxt == goal:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


@pytest.mark.parametrize("module", ["fastdeploy.engine.arg_utils", "fastdeploy.engine.cli_args",
                                    "fastdeploy.utils.argparse_utils"])
def test_flag_modules_have_no_import_cycle(module):
    assert _module_path(module) is not None
    cycle = _reaches(module, module)
    assert cycle is None, " -> ".join(cycle)


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
