"""Checkpoint name -> PaddleFormers parameter, read from PaddleFormers' own mapping declaration.

Every PaddleFormers model class declares how a Hugging Face checkpoint maps onto its
parameters, as "AOA" statements (``cls._gen_aoa_config(config)``), for example::

    model.layers.$LAYER_ID.self_attn.o_proj.weight^T -> model.layers.$LAYER_ID.self_attn.o_proj.weight
    model.layers.$LAYER_ID.self_attn.q_proj.weight^T, ...k_proj.weight^T, ...v_proj.weight^T
        -> model.layers.$LAYER_ID.self_attn.qkv_proj.weight, fused_qkv, num_heads=16, num_key_value_groups=8
    model.layers.$LAYER_ID.mlp.gate_proj.weight^T, ...up_proj.weight^T
        -> model.layers.$LAYER_ID.mlp.up_gate_proj.weight, fused_ffn

This module reads the forms that dense decoders use (rename, ``^T`` transpose,
``fused_qkv``, ``fused_qkv_old``, ``fused_ffn``, ``-> _`` to drop), so the backend needs
no per-architecture table: a Hugging Face tensor resolves to the parameter (and the
shard of a fused parameter) it fills. What the statements mean, at tensor-parallel size 1:

- ``fused_qkv``: per KV head ``j``, the ``H / KVH`` query heads of group ``j``, then key
  head ``j``, then value head ``j`` (PaddleFormers splits its fused output that way);
- ``fused_qkv_old``: the checkpoint's own ``[q | k | v]`` order;
- ``fused_ffn``: ``[gate | up]``.

``$EXPERT_ID`` (MoE experts, one PaddleFormers MLP each) is filled in like ``$LAYER_ID``.
Statements with other placeholders or forms are skipped; the tensors they would map then
show up as unmapped when loading, rather than loading wrongly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastdeploy.logger import init_logger

logger = init_logger(__name__)

_LAYER = "$LAYER_ID"
_LAYER_NUMBER = re.compile(r"\.(\d+)\.")
_EXPERT = "$EXPERT_ID"
_EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")
QKV_SHARDS = ("q", "k", "v")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes.

    Attributes:
        name: PaddleFormers parameter name (``$LAYER_ID`` already filled in).
        shard: None for a whole parameter; "q"/"k"/"v" or 0/1 for one part of a fused one.
        transpose: PaddleFormers stores this parameter transposed from the checkpoint
            (``[in, out]``), as Paddle's ``nn.Linear`` does.
    """

    name: str
    shard: object = None
    transpose: bool = False


@dataclass(frozen=True)
class FusedLayout:
    """How a fused PaddleFormers projection orders its parts (see the module docstring)."""

    kind: str  # "fused_qkv" (per KV head), "fused_qkv_old" ([q | k | v]) or "fused_ffn" ([gate | up])
    num_heads: int = 0
    num_kv_heads: int = 0


def _options(tokens: list[str]) -> tuple[str | None, dict[str, str]]:
    """The macro tag and ``key=value`` options that follow a statement's target."""
    tag, values = None, {}
    for token in tokens:
        if "=" in token:
            key, _, value = token.partition("=")
            values[key.strip()] = value.strip()
        elif token:
            tag = token
    return tag, values


class WeightMapping:
    """Checkpoint tensor names -> :class:`Target` s, and the layout of each fused parameter."""

    def __init__(self, statements: list[str]) -> None:
        self._rules: dict[str, list[Target]] = {}  # source pattern -> targets (patterns may hold $LAYER_ID)
        self.dropped: set[str] = set()  # source patterns the statements map to "_"
        self.layouts: dict[str, FusedLayout] = {}  # target pattern -> its fused layout
        for statement in statements:
            if not self._add(statement):
                logger.debug("PaddleFormers mapping statement not used: %s", statement)

    @classmethod
    def for_model_class(cls, model_cls: type, config: Any) -> WeightMapping:
        """The mapping a PaddleFormers model class declares for ``config``."""
        generate = getattr(model_cls, "_gen_aoa_config", None)
        statements = generate(config)["aoa_statements"] if generate is not None else []
        return cls(statements)

    def _add(self, statement: str) -> bool:
        lhs, arrow, rhs = statement.partition("->")
        if not arrow or "$" in statement.replace(_LAYER, "").replace(_EXPERT, ""):
            return False
        sources = [s.strip() for s in lhs.split(",") if s.strip()]
        target, *rest = (t.strip() for t in rhs.split(","))
        tag, values = _options(rest)
        parsed = [(s.removesuffix("^T"), s.endswith("^T")) for s in sources]
        if target == "_":
            self.dropped.update(name for name, _ in parsed)
            return True
        if tag in (None, "fused_qkv_old") and len(parsed) == 1:
            shards: tuple[object, ...] = (None,)
        elif tag == "fused_qkv" and len(parsed) == 3:
            shards = QKV_SHARDS
        elif tag == "fused_ffn" and len(parsed) == 2:
            shards = (0, 1)
        else:
            return False
        if tag is not None:
            heads = int(values.get("num_heads", 0))
            # PaddleFormers' "num_key_value_groups" option holds the number of KV heads.
            self.layouts[target.removesuffix(".weight").removesuffix(".bias")] = FusedLayout(
                tag, heads, int(values.get("num_key_value_groups", 0))
            )
        for (name, transpose), shard in zip(parsed, shards, strict=True):
            self._rules.setdefault(name, []).append(Target(target, shard, transpose))
        return True

    def targets(self, name: str) -> list[Target] | None:
        """Where checkpoint tensor ``name`` goes: [] when it is dropped, None when nothing maps it."""
        rules = self._rules.get(name)
        if rules is not None:
            return list(rules)
        pattern, fills = self._pattern(name)
        rules = self._rules.get(pattern) if fills else None
        if rules is None:
            return [] if pattern in self.dropped or name in self.dropped else None
        return [Target(_fill(t.name, fills), t.shard, t.transpose) for t in rules]

    @staticmethod
    def _pattern(name: str) -> tuple[str, dict[str, str]]:
        """``name`` with its layer (and expert) numbers replaced by the placeholders, and the numbers."""
        fills: dict[str, str] = {}
        match = _LAYER_NUMBER.search(name)
        if match is None:
            return name, fills
        fills[_LAYER] = match.group(1)
        pattern = name[: match.start()] + f".{_LAYER}." + name[match.end() :]
        expert = _EXPERT_NUMBER.search(pattern)
        if expert is not None:
            fills[_EXPERT] = expert.group(1)
            pattern = pattern[: expert.start()] + f".experts.{_EXPERT}." + pattern[expert.end() :]
        return pattern, fills

    def layout(self, module_name: str) -> FusedLayout | None:
        """The fused layout of the projection module ``module_name`` (e.g. ``model.layers.3.self_attn.qkv_proj``)."""
        layout = self.layouts.get(module_name)
        if layout is None:
            layout = self.layouts.get(self._pattern(module_name + ".")[0].removesuffix("."))
        return layout


def _fill(pattern: str, fills: dict[str, str]) -> str:
    for placeholder, number in fills.items():
        pattern = pattern.replace(placeholder, number)
    return pattern
