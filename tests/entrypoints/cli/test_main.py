"""The ``fastdeploy`` command: --version, sub-commands, serve's positional model, bench placeholder."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.cli.collect_env import collect_env
from fastdeploy.entrypoints.cli.main import main
from fastdeploy.entrypoints.cli.serve import ServeSubcommand
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser
from fastdeploy.version import __version__


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == __version__


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("serve", "chat", "complete", "bench", "collect-env"):
        assert name in out


def test_bench_serve_takes_vllm_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--max-concurrency", "--dataset-name", "--random-input-len", "--request-rate", "--save-result"):
        assert flag in out


def test_unknown_serve_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--bogus-flag"])
    assert info.value.code == 2
    assert "--bogus-flag" in capsys.readouterr().err


def _serve_args(*argv: str):
    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    return args


def test_serve_model_positional_option_or_default(tmp_path):
    assert _serve_args().model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _serve_args("/models/a").model == "/models/a"
    assert _serve_args("--model", "/models/b").model == "/models/b"
    config = tmp_path / "c.yaml"
    config.write_text("model: /models/c\nport: 9000\n")
    args = _serve_args("--config", str(config))
    assert args.model == "/models/c" and args.port == 9000
    # The positional model comes before the config's flags.
    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", "/models/d", "--config", str(config), "--port", "9100"])
    command.validate(args)
    assert args.model == "/models/d" and args.port == 9100


def test_collect_env_reports_versions():
    rows = dict(collect_env())
    assert "Python" in rows and "Paddle" in rows and "CPU cores (usable)" in rows
    # The kernel paths the platform chose, as the start-up log names them.
    from fastdeploy.platforms import current_platform

    want = current_platform.get_op_backend().describe(current_platform.resolve_dtype("auto"))
    assert rows["Kernel paths"] == want and want.startswith("linear: ")


@pytest.mark.parametrize("command", ["serve", "chat", "complete", "collect-env"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: fastdeploy" in capsys.readouterr().out
