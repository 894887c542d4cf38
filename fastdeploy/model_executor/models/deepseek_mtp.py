"""DeepSeek-V3's multi-token-prediction (MTP) modules, for speculative decoding (vLLM's ``DeepSeekMTP``).

A V3 checkpoint with ``num_nextn_predict_layers = D`` stores D modules after the decoder,
``model.layers.{num_hidden_layers + k}``. Module k predicts one token further ahead: for the
token at position ``i`` it takes the previous depth's hidden state ``h_i`` (the target model's
output for k = 0) and the embedding of the token at ``i + 1`` (the one already known there),
and computes

    h'_i = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])
    h_i^k = TRM_k(h'_i)                       # a full decoder layer (MLA + MoE) over the sequence
    logits = head(shared_head.norm(h_i^k))

(the DeepSeek-V3 report, section 2.2; the embedding-first order of the concatenation is the
checkpoint's, as vLLM and SGLang load it). Embedding and output head are the target model's
(the report shares them; the checkpoint's per-module copies, ``embed_tokens`` and
``shared_head.head``, are not loaded again). As in vLLM the embedding of a position-0 token is
zeroed: no hidden state precedes it.

Each module's attention layer keeps its own latent cache: :meth:`DeepSeekMTP.get_kv_cache_spec`
gives one :class:`MLAAttentionSpec` per module, to be allocated beside the target's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.layers.attention.kv_cache_spec import MLAAttentionSpec
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import ReplicatedLinear
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from fastdeploy.model_executor.utils import check_all_loaded, load_into

# Tensors of an MTP module that are the target's own (shared embedding and output head).
_SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Layer):
    """The module's final norm; the head itself is the target's LM head."""

    def __init__(self, hidden_size: int, eps: float, dtype: str) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, dtype)


class DeepSeekMultiTokenPredictorLayer(DeepseekV2DecoderLayer):
    """One MTP module: the decoder layer of its index plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``."""

    def __init__(self, target: DeepseekV2ForCausalLM, layer_idx: int, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        c = target.config
        super().__init__(c, layer_idx, target.model.rotary_emb, dtype, quant_config, prefix,
                         build_mlp=target.build_mlp)
        hidden, eps = c.hidden_size, c.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        # Unquantized whatever the target's format (DeepSeek-V3's fp8 checkpoint keeps it bf16, as vLLM builds it).
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, dtype=dtype, prefix=f"{prefix}.eh_proj")
        self.shared_head = SharedHead(hidden, eps, dtype)

    def predict(self, inputs_embeds: paddle.Tensor, positions: paddle.Tensor, previous_hidden_states: paddle.Tensor,
                kv_cache: tuple[paddle.Tensor, ...], attn_metadata: AttentionMetadata) -> paddle.Tensor:
        """``h^k`` ``[T, hidden]`` (before ``shared_head.norm``) of embeddings and the previous depth's states."""
        keep = (positions != 0).astype(inputs_embeds.dtype).unsqueeze(-1)
        e = self.enorm(inputs_embeds * keep)
        h = self.hnorm(previous_hidden_states)
        x = self.eh_proj(paddle.concat([e, h], axis=-1))
        out, residual = self(positions, x, None, kv_cache, attn_metadata)
        return out + residual


class DeepSeekMTP(nn.Layer):
    """The MTP modules of a DeepSeek-V3 checkpoint, sharing the target model's embedding and LM head.

    Interface for a speculative-decoding proposer:

    - ``forward(input_ids [T], positions [T], previous_hidden_states [T, hidden], kv_caches,
      attn_metadata, spec_step_idx=0) -> [T, hidden]``: module ``spec_step_idx % D``; ``input_ids``
      are the tokens one position ahead of ``previous_hidden_states``' (row i: ``t_{i+1}`` beside
      ``h_i``), ``positions`` those of ``h_i``, ``kv_caches`` one ``(latent_cache,)`` per module;
    - ``compute_logits(hidden_states [S, hidden], spec_step_idx=0) -> [S, vocab]`` float32;
    - ``get_kv_cache_spec()``: one :class:`MLAAttentionSpec` per module;
    - :meth:`from_target` builds and loads the modules from the target's checkpoint.

    Args:
        target: the loaded DeepSeek model whose checkpoint holds the modules.

    Raises:
        ValueError: the config has no MTP modules (``num_nextn_predict_layers`` 0 or absent).
    """

    def __init__(self, target: DeepseekV2ForCausalLM, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        c = target.config
        n = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
        if n < 1:
            raise ValueError(f"{type(target).__name__}'s config has num_nextn_predict_layers={n}: "
                             "the checkpoint has no MTP modules to draft with.")
        self.config = c
        self.mtp_start_layer_idx = c.num_hidden_layers
        self.num_mtp_layers = n
        # `target` is not a sublayer: its weights stay the target's (shared, not counted twice).
        object.__setattr__(self, "target", target)
        self.model = nn.Layer()
        self.model.layers = nn.LayerDict({
            str(i): DeepSeekMultiTokenPredictorLayer(target, i, dtype, quant_config, f"model.layers.{i}")
            for i in range(self.mtp_start_layer_idx, self.mtp_start_layer_idx + n)
        })
        self.kv_cache_dtype = target.kv_cache_dtype

    @classmethod
    def from_target(cls, target: DeepseekV2ForCausalLM, model_config: Any, load_format: str = "auto") -> DeepSeekMTP:
        """The modules of ``model_config``'s checkpoint (the target's), loaded and converted like the target."""
        from fastdeploy.model_executor.model_loader.loader import get_weights_iterator, quantization_kwargs

        # The target's --quantization applies to the modules' projections and experts too (as in vLLM).
        mtp = cls(target, target.dtype_name, **quantization_kwargs(model_config, type(target), load_format))
        mtp.eval()
        with paddle.no_grad():
            mtp.load_weights(get_weights_iterator(model_config, load_format))
            mtp.process_weights_after_loading(target.compute_dtype)
        return mtp

    def _layer(self, spec_step_idx: int) -> DeepSeekMultiTokenPredictorLayer:
        return self.model.layers[str(self.mtp_start_layer_idx + spec_step_idx % self.num_mtp_layers)]

    def forward(self, input_ids: paddle.Tensor, positions: paddle.Tensor, previous_hidden_states: paddle.Tensor,
                kv_caches: list[tuple[paddle.Tensor, ...]], attn_metadata: AttentionMetadata,
                spec_step_idx: int = 0) -> paddle.Tensor:
        embeds = self.target.model.embed_tokens(input_ids)
        kv_cache = kv_caches[spec_step_idx % self.num_mtp_layers]
        return self._layer(spec_step_idx).predict(embeds, positions, previous_hidden_states, kv_cache, attn_metadata)

    def compute_logits(self, hidden_states: paddle.Tensor, spec_step_idx: int = 0) -> paddle.Tensor:
        """Logits ``[S, vocab]`` float32 through the module's ``shared_head.norm`` and the target's head."""
        normed = self._layer(spec_step_idx).shared_head.norm(hidden_states)
        return self.target.logits_processor(self.target.lm_head, normed)

    def get_kv_cache_spec(self) -> list[MLAAttentionSpec]:
        """One latent per token for each module's attention layer."""
        return [MLAAttentionSpec(1, self.target.head_dim, self.kv_cache_dtype)] * self.num_mtp_layers

    def process_weights_after_loading(self, dtype: str) -> None:
        """Convert the modules' weights as the target converted its own (same kernels, same dtype, same order:
        experts, matmuls, then MLA's absorbed weights from the matmuls' packed values)."""
        from fastdeploy.model_executor.layers.linear import process_linear_weights
        from fastdeploy.model_executor.models.moe import fuse_shared_experts, pack_experts

        pack_experts(self, dtype)
        process_linear_weights(self, dtype)
        fuse_shared_experts(self)
        for layer in self.model.layers.values():
            layer.process_weights_after_loading()
        self.kv_cache_dtype = "bfloat16" if dtype == "bfloat16" else "float32"

    def load_weights(self, weights: Iterable[tuple[str, np.ndarray]]) -> set[str]:
        """Load ``model.layers.{num_hidden_layers + k}.*`` from a whole-checkpoint iterator (the rest is skipped).

        Raises:
            ValueError: a shape does not match, or a module parameter got no tensor.
        """
        params = dict(self.named_parameters())
        layers = dict(self.named_sublayers())
        loaded: dict[str, set[object]] = {}
        prefixes = tuple(f"model.layers.{i}." for i in range(self.mtp_start_layer_idx,
                                                              self.mtp_start_layer_idx + self.num_mtp_layers))
        for hf_name, array in weights:
            if not hf_name.startswith(prefixes) or hf_name.endswith(_SHARED_WITH_TARGET):
                continue
            resolved = self.target.resolve_layer_name(hf_name)
            if resolved is None:
                continue
            name, shard = resolved
            if name not in params:
                raise ValueError(f"MTP checkpoint tensor {hf_name} has no parameter in DeepSeekMTP.")
            loader = getattr(layers.get(name.rpartition(".")[0]), "weight_loader", None)
            if loader is not None:
                loader(params[name], array, shard)
            else:
                load_into(params[name], array, hf_name)
            loaded.setdefault(name, set()).add(shard)
        check_all_loaded(params, layers, loaded)
        return set(loaded)
