"""``fastdeploy chat -q`` and ``fastdeploy complete -q`` against the running server."""

from __future__ import annotations

import argparse

import pytest

from fastdeploy.entrypoints.cli.openai import ChatCommand, CompleteCommand

pytestmark = pytest.mark.slow


def _args(server, **extra) -> argparse.Namespace:
    return argparse.Namespace(url=server.url_for("v1"), model_name=None, api_key=server.api_key, max_tokens=20,
                              **extra)


def test_chat_quick(server, capsys):
    ChatCommand.cmd(_args(server, system_prompt=None, quick="What is the capital of France?"))
    # The CLI samples with the server's defaults (temperature 1): any answer will do.
    assert capsys.readouterr().out.strip()


def test_complete_quick(server, capsys):
    CompleteCommand.cmd(_args(server, quick="The capital of France is"))
    assert capsys.readouterr().out.strip()
