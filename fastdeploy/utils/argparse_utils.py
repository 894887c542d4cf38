"""``FlexibleArgumentParser``: argparse with vLLM's conveniences.

- ``--config file.yaml`` inserts the file's ``key: value`` pairs as flags, right
  after the sub-command (and the ``serve`` positional model), so flags given on
  the command line win over the file.
- ``--max_model_len`` is read as ``--max-model-len`` (underscores accepted).
- JSON-valued flags can also be given key by key: ``--speculative-config.method ngram``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import yaml

_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")


def parse_size(value: str | int) -> int:
    """``2048``, ``1k`` (1000), ``1K`` (1024), ``32K``, ``1m``/``1M``... as vLLM's --max-model-len."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value).strip())
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {value!r}: expected an integer optionally followed by k/K/m/M/g/G")
    number, suffix = float(m.group(1)), m.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2, "g": 1000**3, "G": 1024**3}[suffix]
    return int(number * scale)


def parse_json(value: str | dict | None) -> dict | None:
    """A JSON-object flag value (text or an already parsed dict); anything else is an ArgumentTypeError."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {e}") from e
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def _coerce_scalar(text: str) -> Any:
    """A dotted-flag value: JSON when it parses (numbers, booleans, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config_to_args(config: dict[str, Any], path: str) -> list[str]:
    """Turn the mapping of a YAML config file into command-line flags."""
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
            else:
                # ``enable-prefix-caching: false`` -> the BooleanOptionalAction negative form.
                args.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif isinstance(value, list):
            if not value:
                continue
            args.append(flag)
            args += [str(v) for v in value]
        elif value is None:
            continue
        else:
            args += [flag, str(value)]
    if not args and config:
        raise ValueError(f"Config file {path} holds no usable settings.")
    return args


def load_config_file(path: str) -> list[str]:
    """Flags from a YAML config file (``port: 8000``, ``enable-prefix-caching: false``, ...)."""
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"Config file must be of a yaml/yml type. {path} supplied")
    if not os.path.isfile(path):
        raise ValueError(f"Config file {path} does not exist.")
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"Config file {path} must hold a mapping of flag names to values.")
    return _config_to_args(config, path)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser that accepts ``--config``, underscores in flag names and dotted JSON flags."""

    def parse_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None):  # type: ignore[override]
        """Parse after expanding ``--config`` and normalising flag spellings."""
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in args or any(a.startswith("--config=") for a in args):
            try:
                args = self._pull_args_from_config(args)
            except ValueError as e:
                self.error(str(e))
        args = [self._normalise_flag(a) for a in args]
        args = self._merge_dotted_json_flags(args)
        return super().parse_args(args, namespace)

    @staticmethod
    def _normalise_flag(arg: str) -> str:
        if not arg.startswith("--") or arg == "--":
            return arg
        key, sep, value = arg.partition("=")
        return "--" + key[2:].replace("_", "-") + sep + value

    def _all_json_flags(self) -> set[str]:
        """Long names of the flags typed :func:`optional_json`, sub-commands included."""
        flags: set[str] = set()
        parsers = [self]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
                elif action.type is optional_json:
                    flags.update(n for n in action.option_strings if n.startswith("--"))
        return flags

    def _merge_dotted_json_flags(self, args: list[str]) -> list[str]:
        """``--speculative-config.method ngram --speculative-config.num_speculative_tokens 3`` -> one JSON flag."""
        json_flags = self._all_json_flags()
        merged: dict[str, dict[str, Any]] = {}
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            head = arg.split("=", 1)[0]
            base, dot, path = head.partition(".")
            if dot and base in json_flags:
                if "=" in arg:
                    value = arg.split("=", 1)[1]
                    i += 1
                elif i + 1 < len(args):
                    value = args[i + 1]
                    i += 2
                else:
                    self.error(f"argument {head}: expected one argument")
                node = merged.setdefault(base, {})
                keys = path.replace("-", "_").split(".")
                for key in keys[:-1]:
                    node = node.setdefault(key, {})
                node[keys[-1]] = _coerce_scalar(value)
                continue
            out.append(arg)
            i += 1
        for flag, value in merged.items():
            # A full JSON value given too is merged under the dotted keys.
            if flag in out:
                idx = out.index(flag)
                try:
                    base_value = json.loads(out[idx + 1])
                except (IndexError, json.JSONDecodeError):
                    base_value = {}
                del out[idx : idx + 2]
                value = {**base_value, **value}
            out += [flag, json.dumps(value)]
        return out

    def _pull_args_from_config(self, args: list[str]) -> list[str]:
        """Insert the config file's flags after the sub-command (and the ``serve`` model)."""
        indexes = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
        if len(indexes) > 1:
            raise ValueError("More than one config file specified!")
        index = indexes[0]
        if args[index] == "--config":
            if index == len(args) - 1:
                raise ValueError("No config file specified! Please check your command-line arguments.")
            path, rest = args[index + 1], args[:index] + args[index + 2 :]
        else:
            path, rest = args[index].split("=", 1)[1], args[:index] + args[index + 1 :]
        config_args = load_config_file(path)
        if not rest or rest[0].startswith("-"):
            return config_args + rest
        head = 1
        if rest[0] == "serve" and len(rest) > 1 and not rest[1].startswith("-"):
            head = 2
        return rest[:head] + config_args + rest[head:]


def optional_json(value: str) -> dict[str, Any] | None:
    """argparse type of a JSON-object flag (``None``/``null`` -> None)."""
    if value in ("", "None", "null"):
        return None
    return parse_json(value)
