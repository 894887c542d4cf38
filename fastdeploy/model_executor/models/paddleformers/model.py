"""``PaddleFormersForCausalLM``: a PaddleFormers decoder run as a FastDeploy model.

The class has the native models' interface (``Model(hf_config, dtype)``, ``forward``,
``compute_logits``, ``load_weights``, ``num_layers`` / ``num_kv_heads`` / ``head_dim``),
so the loader, the model runner and the engine treat it like any native model.

Build, for the checkpoint's architecture:

1. the PaddleFormers config, from the checkpoint's (already loaded) config dict, with the
   CPU fixes applied: ``fuse_rms_norm=False`` (no CPU kernel), ``pad_token_id=None``
   (PaddleFormers uses it as the embedding's padding index, which zeroes that token:
   SmolLM2's pad id 2 is ``<|im_end|>``), tensor/sequence parallelism off, RoPE fusion
   off, and our attention implementation;
2. the PaddleFormers model, under ``paddle.LazyGuard`` so its random initialisation is
   skipped for the layers that are swapped out anyway;
3. the swap (layers.py), the paged-attention adapters (attention.py) and our LM head.

Weights come from FastDeploy's own iterators (safetensors, GGUF, ``.bin``, dummy) through
the name mapping PaddleFormers declares (weights.py). ``from_pretrained`` is never
called, so PaddleFormers never writes into the model folder (it would add
``flex-ckpt.auto_generated.metadata`` there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.linear import process_linear_weights
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessor
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead
from fastdeploy.model_executor.models.paddleformers.attention import (
    ATTN_IMPLEMENTATION,
    ForwardContext,
    attach_paged_attention,
    register_attention_implementation,
)
from fastdeploy.model_executor.models.paddleformers.compat import (
    check_config,
    find_model_class,
    import_paddleformers,
    supported_architectures,
    unsupported_reasons,
)
from fastdeploy.model_executor.models.paddleformers.layers import LayerSwapper
from fastdeploy.model_executor.models.paddleformers.weights import Target, WeightMapping
from fastdeploy.model_executor.utils import check_all_loaded, load_into

logger = init_logger(__name__)

# Config switches that select PaddleFormers' training-only or GPU-only paths.
_CONFIG_OVERRIDES: dict[str, Any] = {
    "fuse_rms_norm": False,  # fused_rms_norm_ext has no CPU kernel
    "pad_token_id": None,  # else nn.Embedding(padding_idx=pad) zeroes that token
    "tensor_model_parallel_size": 1,
    "sequence_parallel": False,
    "apply_rope_fusion": False,  # fused_rope is a GPU kernel
    "use_cache": False,  # the paged cache replaces PaddleFormers' DynamicCache
    "use_fused_head_and_loss_fn": False,
    "output_hidden_states": False,
    "_attn_implementation": ATTN_IMPLEMENTATION,
}
# Checkpoint entries that are buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def pick_architecture(architectures: list[str]) -> tuple[str, type]:
    """The first of ``architectures`` PaddleFormers can build, with its class.

    Raises:
        ValueError: none of them (the message lists what PaddleFormers supports here).
    """
    import_paddleformers()
    for arch in architectures:
        cls = find_model_class(arch)
        if cls is not None:
            return arch, cls
    why = unsupported_reasons(architectures)
    raise ValueError(
        f"PaddleFormers has no implementation of {list(architectures)} usable here.{why} "
        f"Supported through PaddleFormers (model_impl='paddleformers'): {list(supported_architectures())}"
    )


def build_paddleformers_config(model_cls: type, hf_config: Any) -> Any:
    """The PaddleFormers config of ``model_cls`` from a transformers config, with the CPU fixes applied."""
    values = hf_config.to_dict()
    config = model_cls.config_class.from_dict(values)
    for key, value in _CONFIG_OVERRIDES.items():
        setattr(config, key, value)
    # One op for silu(gate) * up; only valid when the MLP's activation is SiLU.
    config.fuse_swiglu = getattr(config, "hidden_act", None) == "silu"
    return config


@contextlib.contextmanager
def _default_dtype(dtype: str) -> Iterator[None]:
    """Create PaddleFormers' own parameters in the engine's dtype."""
    previous = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(previous)


class PaddleFormersForCausalLM(nn.Layer):
    """A PaddleFormers causal LM behind FastDeploy's model interface (see the module docstring).

    Args:
        hf_config: the checkpoint's transformers config (``ModelConfig.hf_config``).
        dtype: parameter dtype.
        fuse_projections: fuse Q/K/V and gate/up projections PaddleFormers keeps separate.
    """

    def __init__(self, hf_config: Any, dtype: str = "float32", fuse_projections: bool = True) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype_name = dtype
        self.architecture, pf_cls = pick_architecture(list(getattr(hf_config, "architectures", None) or []))
        self.pf_class_name = pf_cls.__name__
        check_config(self.architecture, hf_config)
        self.pf_config = build_paddleformers_config(pf_cls, hf_config)
        register_attention_implementation()
        with _default_dtype(dtype), paddle.LazyGuard():
            causal_lm = pf_cls(self.pf_config)
        prefix = getattr(pf_cls, "base_model_prefix", "model")
        # The decoder stack only: our LM head and logits processor replace PaddleFormers' head.
        self.model = getattr(causal_lm, prefix)
        self.mapping = WeightMapping.for_model_class(pf_cls, self.pf_config)
        self.swapper = LayerSwapper(self.mapping, dtype, fuse=fuse_projections)
        self.swapper.swap(self.model, prefix)
        self._context = ForwardContext()
        attention = attach_paged_attention(self.model, self.pf_config, self._context)
        cfg = self.pf_config
        self.num_layers = int(cfg.num_hidden_layers)
        if len(attention) != self.num_layers:
            raise ValueError(
                f"Found {len(attention)} attention modules in PaddleFormers' {self.pf_class_name}, "
                f"expected one per layer ({self.num_layers}): its attention cannot be routed to the paged cache."
            )
        # Set by process_weights_after_loading, as for the native models.
        self.compute_dtype = "float32"
        self.kv_cache_dtype = "float32"
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, bias=bool(getattr(cfg, "lm_head_bias", False)), dtype=dtype
        )
        soft_cap = getattr(cfg, "final_logit_softcapping", None)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, soft_cap=soft_cap)
        self._materialize()
        logger.info(
            "PaddleFormers backend: %s as %s; swapped %s; fused projections: %d.",
            self.architecture,
            self.pf_class_name,
            dict(sorted(self.swapper.counts.items())),
            len(self.swapper.fused),
        )

    def _materialize(self) -> None:
        """Allocate the PaddleFormers parameters that were not swapped, and make every parameter inference-only."""
        for param in self.parameters():
            if hasattr(param, "_is_initialized") and not param._is_initialized():
                param.initialize()
            param.stop_gradient = True

    def process_weights_after_loading(self, dtype: str) -> None:
        """Convert the swapped layers' weights once for ``dtype``, as the native models do.

        Our linear layers and LM head are packed for the C++ oneDNN kernel (bf16 when
        ``dtype`` is bfloat16); PaddleFormers' own remaining parameters stay as they are.
        The KV cache stays fp32 even under bf16 compute: PaddleFormers hands attention
        K/V that already went through its own RoPE, so the cache is written with
        ``PagedAttention.forward``'s scatter, which has no bf16 kernel on CPU (the native
        models write it inside the fused RoPE+cache kernel instead).

        Raises:
            RuntimeError: ``dtype`` is bfloat16 but the kernels are not available.
        """
        self.compute_dtype = process_linear_weights(self, dtype)
        self.kv_cache_dtype = "float32"

    # ---- the model interface ------------------------------------------------------------
    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> paddle.Tensor:
        """``input_ids`` / ``positions`` ``[T]`` -> final hidden states ``[T, hidden]``.

        The flattened step runs as one sequence of batch 1; attention separates the
        requests again through ``attn_metadata``.
        """
        self._context.set(kv_caches, attn_metadata)
        try:
            outputs = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                return_dict=False,
            )
        finally:
            self._context.clear()
        hidden = outputs[0] if isinstance(outputs, tuple | list) else outputs
        return hidden.reshape([-1, hidden.shape[-1]])

    def compute_logits(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """Logits ``[S, vocab]`` float32 of the hidden states of the positions being sampled."""
        return self.logits_processor(self.lm_head, hidden_states)

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    # ---- weights ------------------------------------------------------------------------
    def _resolve(self, hf_name: str, params: dict[str, paddle.Tensor]) -> list[Target] | None:
        """Where a checkpoint tensor goes (after our fusions); None when nowhere."""
        targets = self.mapping.targets(hf_name)
        if targets is None and hf_name in params:
            # A tensor PaddleFormers' statements do not mention but whose name is a parameter
            # (e.g. an attention bias): loaded as is, like PaddleFormers' loader does.
            targets = [Target(hf_name)]
        if targets is None:
            return None
        resolved = []
        for t in targets:
            name, shard = self.swapper.redirects.get(t.name, (t.name, t.shard))
            resolved.append(Target(name, shard, t.transpose))
        return resolved

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> set[str]:
        """Load Hugging Face-named tensors through PaddleFormers' name mapping.

        Our layers take the checkpoint layout through their ``weight_loader`` (fusing as
        they go); PaddleFormers' remaining parameters get the tensor as its mapping says
        (transposed where it marks ``^T``).

        Raises:
            ValueError: a checkpoint tensor has no place in the model (the PaddleFormers
                class does not match the checkpoint), or model weights were not loaded.
        """
        params = dict(self.named_parameters())
        layers = dict(self.named_sublayers())
        loaded: dict[str, set[object]] = {}
        unmapped: list[str] = []
        for hf_name, array in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            targets = self._resolve(hf_name, params)
            if targets is None or any(t.name not in params for t in targets):
                unmapped.append(hf_name)
                continue
            for t in targets:
                param = params[t.name]
                loader = getattr(layers.get(t.name.rpartition(".")[0]), "weight_loader", None)
                if loader is not None:
                    loader(param, array, t.shard)
                else:
                    load_into(param, array.T if t.transpose else array, hf_name)
                loaded.setdefault(t.name, set()).add(t.shard)
        if unmapped:
            raise ValueError(
                f"{len(unmapped)} checkpoint tensors have no place in PaddleFormers' {self.pf_class_name}, "
                f"e.g. {unmapped[:6]}: the checkpoint does not match what PaddleFormers implements."
            )
        if "lm_head.weight" not in loaded:
            self.lm_head.tie_weights(self.model.embed_tokens)
            loaded["lm_head.weight"] = {None}
        check_all_loaded(params, layers, loaded)
        return set(loaded)
