"""fastdeploy/envs.py: every environment variable the package reads goes through it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy import envs

PACKAGE = Path(__file__).resolve().parents[1] / "fastdeploy"
_ENV_NAMES = {"environ", "environb", "getenv", "getenvb"}


def _stray_reads(source: str) -> list[int]:
    """Lines that read the environment: any use of ``os.environ``/``os.getenv`` but ``os.environ[name] = value``."""
    tree = ast.parse(source)
    stores = {id(node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES and id(node) not in stores:
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            lines.extend(node.lineno for alias in node.names if alias.name in _ENV_NAMES)
    return sorted(lines)


def test_the_check_sees_reads_and_allows_writes() -> None:
    source = ("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('X')\nc = 'X' in os.environ\n"
              "d = dict(os.environ)\nos.environ['X'] = '1'\n")
    assert _stray_reads(source) == [2, 3, 4, 5, 6]


def test_no_environment_read_outside_envs_py() -> None:
    stray = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "envs.py"
             for line in _stray_reads(path.read_text())]
    assert stray == [], "read environment variables through a documented function of fastdeploy/envs.py"


def test_every_reader_is_documented() -> None:
    tree = ast.parse((PACKAGE / "envs.py").read_text())
    public = [node for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    assert public and all(ast.get_docstring(node) for node in public)


@pytest.mark.parametrize(("reader", "names", "default"), [
    (envs.max_n_sequences, ("FD_MAX_N_SEQUENCES", "VLLM_MAX_N_SEQUENCES"), 16384),
    (envs.max_num_bad_words, ("FD_MAX_NUM_BAD_WORDS", "VLLM_MAX_NUM_BAD_WORDS"), 128),
])
def test_integer_limits(monkeypatch: pytest.MonkeyPatch, reader, names: tuple[str, str], default: int) -> None:
    fd_name, vllm_name = names
    monkeypatch.delenv(fd_name, raising=False)
    monkeypatch.delenv(vllm_name, raising=False)
    assert reader() == default
    monkeypatch.setenv(vllm_name, "7")
    assert reader() == 7
    monkeypatch.setenv(fd_name, "5")  # FastDeploy's name first
    assert reader() == 5
    monkeypatch.setenv(fd_name, "many")
    with pytest.raises(ValueError, match=f"{fd_name} must be an integer, got 'many'"):
        reader()


def test_child_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FD_TEST_KEPT", "before")
    monkeypatch.delenv("FD_TEST_NEW", raising=False)
    with envs.child_environment({"FD_TEST_KEPT": "child", "FD_TEST_NEW": "child"}):
        assert os.environ["FD_TEST_KEPT"] == os.environ["FD_TEST_NEW"] == "child"
    assert os.environ["FD_TEST_KEPT"] == "before" and "FD_TEST_NEW" not in os.environ
    assert envs.environment_with({"FD_TEST_NEW": "x"})["FD_TEST_NEW"] == "x" and "FD_TEST_NEW" not in os.environ


@pytest.mark.parametrize("user_value", [None, "3"])
def test_import_sets_omp_num_threads_before_paddle(user_value: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_value is not None:
        env["OMP_NUM_THREADS"] = user_value
    code = ("import os, sys, fastdeploy; assert 'paddle' not in sys.modules; "
            "print(os.environ['OMP_NUM_THREADS'], fastdeploy.USER_SET_OMP_NUM_THREADS)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    expected = user_value or str(len(os.sched_getaffinity(0)))
    assert out.split() == [expected, str(user_value is not None)]
