"""Tiny random Qwen2.5-VL, PaddleOCR-VL and ERNIE-4.5-VL checkpoints, written with transformers at test time.

The tokenizer is the embedded SmolLM2 tokenizer (a real byte-level BPE) with the model's vision
special tokens added and a chat template in the model's style that writes its image markers
(Qwen2-VL's ``<|vision_start|><|image_pad|><|vision_end|>``, PaddleOCR-VL's
``<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>``) for each image part, so prompts go
through the same template path as a released checkpoint.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PADDLEOCR_TOKENS = ["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|video_pad|>"]
# ERNIE-4.5-VL's (Baidu's vocabulary): start, end, image, video, then the video's start and end.
ERNIE_VL_TOKENS = ["<|IMAGE_START|>", "<|IMAGE_END|>", "<|IMAGE_PLACEHOLDER|>", "<|VIDEO_PLACEHOLDER|>",
                   "<|VIDEO_START|>", "<|VIDEO_END|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: str, tokens: list[str] = VISION_TOKENS) -> Any:
    """Save the SmolLM2 tokenizer plus the vision ``tokens`` (start, end, image, video) and the
    template writing ``start image end`` per image into ``path``; returns it."""
    from fastdeploy.transformers_utils.model_resolver import resolve_model
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    folder, gguf = resolve_model(None)
    tok = get_tokenizer(folder, gguf_file=gguf)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.chat_template = CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                              tokens[0] + tokens[2] + tokens[1])
    tok.save_pretrained(path)
    return tok


def tiny_qwen2_5_vl_config(tok: Any, **text_overrides: Any):
    import transformers

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = len(tok)
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **text_overrides)
    # window_size 28: one 2x2 merged group per window, so the windowed blocks differ from the full one.
    # tokens_per_second 1: transformers 5.3 multiplies an image's time index by it (vLLM and the
    # released model do not); at 1 both agree.
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=28, fullatt_block_indexes=[1],
                  tokens_per_second=1)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
        eos_token_id=text["eos_token_id"])
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def tiny_paddleocr_vl_config(tok: Any):
    import transformers

    ids = {t: tok.convert_tokens_to_ids(t) for t in PADDLEOCR_TOKENS}
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, use_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                eos_token_id=eos, tie_word_embeddings=False)
    # image_size 56: a 4x4 position table, resized for any other patch grid.
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                  image_size=56, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    cfg = transformers.PaddleOCRVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|IMAGE_PLACEHOLDER|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|IMAGE_START|>"],
        tie_word_embeddings=False, eos_token_id=eos)
    cfg.architectures = ["PaddleOCRVLForConditionalGeneration"]
    return cfg


def tiny_ernie4_5_vl_config(tok: Any):
    import transformers

    ids = [tok.convert_tokens_to_ids(t) for t in ERNIE_VL_TOKENS]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    # Layer 0 dense, 1 and 2 sparse; each pool has its own expert width (text 32, vision 16).
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, use_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
                moe_intermediate_size=[32, 16], moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                eos_token_id=eos)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14, spatial_merge_size=2,
                  temporal_merge_size=2, hidden_act="quick_gelu", rms_norm_eps=1e-6)
    cfg = transformers.Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, image_start_token_id=ids[0], image_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], video_start_token_id=ids[4], video_end_token_id=ids[5],
        tie_word_embeddings=False, eos_token_id=eos)
    cfg.architectures = ["Ernie4_5_VLMoeForConditionalGeneration"]
    return cfg


def build_tiny_ernie4_5_vl(path: str | os.PathLike, seed: int = 0) -> str:
    """The same for ERNIE-4.5-VL (random router correction biases, so they decide some choices)."""
    import transformers

    path = str(path)
    tok = build_tokenizer(path, ERNIE_VL_TOKENS)
    # Larger expert weights: which pool a token goes to then shows in the answer.
    _save_random(transformers.Ernie4_5_VLMoeForConditionalGeneration, tiny_ernie4_5_vl_config(tok), path, seed,
                 stds={"_moe.": 0.3})
    transformers.Ernie4_5_VLMoeImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
                                              ).save_pretrained(path)
    return path


def build_tiny_qwen2_5_vl(path: str | os.PathLike, seed: int = 0) -> str:
    """Write tokenizer, image processor config, config and random weights; returns the folder."""
    import transformers

    path = str(path)
    tok = build_tokenizer(path)
    _save_random(transformers.Qwen2_5_VLForConditionalGeneration, tiny_qwen2_5_vl_config(tok), path, seed)
    # Small images stay small: 56x56 -> a 4x4 patch grid -> 4 image tokens.
    transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(path)
    return path


def build_tiny_paddleocr_vl(path: str | os.PathLike, seed: int = 0) -> str:
    """The same for PaddleOCR-VL."""
    import transformers

    path = str(path)
    tok = build_tokenizer(path, PADDLEOCR_TOKENS)
    _save_random(transformers.PaddleOCRVLForConditionalGeneration, tiny_paddleocr_vl_config(tok), path, seed)
    transformers.PaddleOCRVLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(path)
    return path


def _save_random(model_cls: Any, cfg: Any, path: str, seed: int, stds: dict[str, float] | None = None) -> None:
    """Random weights (norm weights near 1, biases small but non-zero so they matter), saved.

    ``stds``: name fragment -> the std of the matching matrices instead of 0.08."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or ".ln." in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                std = next((v for k, v in (stds or {}).items() if k in name), 0.08)
                p.copy_((std if p.ndim > 1 else 0.05) * torch.randn_like(p))
    model.save_pretrained(path)


def random_image(seed: int, size: tuple[int, int] = (56, 56)):
    """A noise RGB image (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
