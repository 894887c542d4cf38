"""Qwen2.5-VL, PaddleOCR-VL and ERNIE-4.5-VL in Paddle against transformers on tiny random checkpoints (fp32, greedy).

One ``LLM`` serves every test; its small ``max_num_batched_tokens`` makes the image prompts
prefill in chunks that cut through the images, so the encoder cache and the 3-D positions of
later chunks are exercised too.
"""

import base64

import numpy as np
import pytest

from tests.multimodal.utils import (
    ERNIE_VL_TOKENS,
    PADDLEOCR_TOKENS,
    VISION_TOKENS,
    build_tiny_ernie4_5_vl,
    build_tiny_paddleocr_vl,
    build_tiny_qwen2_5_vl,
    random_image,
)

MAX_TOKENS = 20
# architecture -> (checkpoint builder, transformers image processor, its tokens: start, end, image, video, ...)
MODELS = {
    "Qwen2_5_VLForConditionalGeneration": (build_tiny_qwen2_5_vl, "Qwen2VLImageProcessor", VISION_TOKENS),
    "PaddleOCRVLForConditionalGeneration": (build_tiny_paddleocr_vl, "PaddleOCRVLImageProcessor", PADDLEOCR_TOKENS),
    "Ernie4_5_VLMoeForConditionalGeneration": (build_tiny_ernie4_5_vl, "Ernie4_5_VLMoeImageProcessor",
                                               ERNIE_VL_TOKENS),
}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_vl(request, tmp_path_factory):
    """(checkpoint folder, our LLM, transformers model, image marker) of one tiny model."""
    import torch
    import transformers

    from fastdeploy import LLM

    build, _, (start, end, image, *_) = MODELS[request.param]
    path = build(tmp_path_factory.mktemp(request.param))
    hf = getattr(transformers, request.param).from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
              max_num_batched_tokens=24, limit_mm_per_prompt={"image": 2})
    assert type(llm.llm_engine.engine_core.worker.model_runner.model).__name__ == request.param
    yield path, llm, hf, (start, image, end)
    del llm


def _params():
    from fastdeploy import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _chat(llm, images, text="Describe the picture."):
    parts = [{"type": "image_pil", "image_pil": im} for im in images] + [{"type": "text", "text": text}]
    return llm.chat([{"role": "user", "content": parts}], _params(), use_tqdm=False)[0]


def _hf_generate(hf, prompt_ids, images, image_processor, image_token_id):
    import torch

    ids = torch.tensor([prompt_ids])
    kwargs = {}
    if images:
        processed = image_processor(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                      mm_token_type_ids=(ids == image_token_id).int())
        if hasattr(hf.config, "image_end_token_id"):  # ERNIE-4.5-VL: its processor's routing of the markers too
            vision = [image_token_id, hf.config.image_start_token_id, hf.config.image_end_token_id]
            kwargs["moe_mm_token_type_ids"] = torch.isin(ids, torch.tensor(vision)).int()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def hf_image_processor(tiny_vl):
    import transformers

    arch = type(tiny_vl[2]).__name__
    return getattr(transformers, MODELS[arch][1]).from_pretrained(tiny_vl[0])


def test_processing_matches_hf_processor(tiny_vl, hf_image_processor):
    """Pixel values and grid equal the HF image processor's; each placeholder is expanded as the HF
    processor expands it (the token repeated grid.prod() / merge**2 times)."""
    _, llm, hf, marker = tiny_vl
    processor = llm.llm_engine.processor
    tok = llm.get_tokenizer()
    images = [random_image(1), random_image(2, (112, 84))]
    text = "a{0}{1}{2}b{0}{1}{2}c".format(*marker)
    pad = marker[1]
    prompt = processor.process_prompt({"prompt": text, "multi_modal_data": {"image": images}})
    ref = hf_image_processor(images=images, return_tensors="np")
    got_pixels = np.concatenate([f.pixel_values.to_array() for f in prompt.mm_features])
    np.testing.assert_array_equal(got_pixels, ref["pixel_values"])
    assert [f.grid_thw for f in prompt.mm_features] == ref["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    counts = [int(np.prod(g)) // 4 for g in ref["image_grid_thw"]]
    pieces = text.split(pad)
    expanded = pieces[0] + pad * counts[0] + pieces[1] + pad * counts[1] + pieces[2]
    assert prompt.token_ids == tok.encode(expanded)
    image_id = hf.config.image_token_id
    assert [(f.offset, f.length) for f in prompt.mm_features] == [
        (prompt.token_ids.index(image_id), counts[0]),
        (len(prompt.token_ids) - prompt.token_ids[::-1].index(image_id) - counts[1], counts[1])]


def _encoder_cache(llm):
    return llm.llm_engine.engine_core.worker.model_runner.mm_state.encoder_cache


@pytest.mark.parametrize("num_images", [1, 2])
def test_greedy_matches_transformers(tiny_vl, hf_image_processor, num_images):
    _, llm, hf, _ = tiny_vl
    images = [random_image(10), random_image(11, (112, 84))][:num_images]
    encoded = _encoder_cache(llm).num_encoded
    out = _chat(llm, images)
    want = _hf_generate(hf, out.prompt_token_ids, images, hf_image_processor, hf.config.image_token_id)
    assert list(out.outputs[0].token_ids) == want
    # The prompt prefilled in chunks of at most 24 tokens (the 12-token image was split), yet the
    # vision tower ran once per image; the finished request's entries were freed.
    assert len(out.prompt_token_ids) > 24
    assert _encoder_cache(llm).num_encoded - encoded == num_images
    assert not _encoder_cache(llm).outputs


def test_text_only_prompt_matches_transformers(tiny_vl, hf_image_processor):
    _, llm, hf, _ = tiny_vl
    out = llm.chat([{"role": "user", "content": "Just text, no picture."}], _params(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_generate(hf, out.prompt_token_ids, [], hf_image_processor, -1)


def test_images_behind_the_same_tokens_are_not_confused(tiny_vl):
    """Two different images give the same prompt ids but different answers; the same image again
    is served from the prefix cache (and the encoder cache), with the same answer."""
    _, llm, _, marker = tiny_vl
    llm.reset_prefix_cache()
    first = _chat(llm, [random_image(20, (112, 84))])
    other = _chat(llm, [random_image(21, (112, 84))])
    assert first.prompt_token_ids == other.prompt_token_ids
    assert other.num_cached_tokens < 16  # the blocks holding the image tokens were not reused
    assert first.outputs[0].token_ids != other.outputs[0].token_ids
    again = _chat(llm, [random_image(20, (112, 84))])
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


_PROMPT = "<|im_start|>user\n{marker}Hi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("kind, match", [
    ("bad_base64", "Invalid base64"),
    ("not_an_image", "Failed to load image"),
    ("file_without_flag", "allowed-local-media-path"),
    ("too_many", "passed 3 image items"),
    ("not_pil", "must be a PIL.Image"),
    ("no_placeholder", "0 image placeholders"),
])
def test_bad_image_inputs_are_value_errors(tiny_vl, kind, match):
    _, llm, _, marker = tiny_vl
    url = {"bad_base64": "data:image/png;base64,@@@", "file_without_flag": "file:///etc/hostname",
           "not_an_image": "data:image/png;base64," + base64.b64encode(b"plain text").decode()}.get(kind)
    with pytest.raises(ValueError, match=match):
        if url is not None:
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], _params())
        elif kind == "too_many":
            _chat(llm, [random_image(1)] * 3)
        else:
            image = np.zeros((56, 56, 3)) if kind == "not_pil" else random_image(1)
            prompt = _PROMPT.format(marker="".join(marker)) if kind == "not_pil" else "no placeholder here"
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, _params(), use_tqdm=False)
    # The engine is unharmed.
    prompt = {"prompt": _PROMPT.format(marker="".join(marker)), "multi_modal_data": {"image": random_image(1)}}
    assert len(llm.generate(prompt, _params(), use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_text_only_model_refuses_images(smol_llm):
    with pytest.raises(ValueError, match="not a multimodal model"):
        smol_llm.generate({"prompt": "Hi", "multi_modal_data": {"image": random_image(1)}})


@pytest.mark.parametrize("tiny_vl", ["Ernie4_5_VLMoeForConditionalGeneration"], indirect=True)
def test_ernie_4_5_vl_checkpoint_layouts_and_videos(tiny_vl):
    """Baidu's layout (what the checkpoint holds: both pools in one expert list, transposed routers,
    a [2, E] bias) and transformers' in-memory names load the same weights; videos are refused by name."""
    import glob

    from safetensors.numpy import load_file

    from fastdeploy.model_executor.models.ernie4_5_vl import Ernie4_5_VLMoeForConditionalGeneration

    path, llm, hf, _ = tiny_vl
    (shard,) = glob.glob(f"{path}/*.safetensors")
    assert "model.layers.1.mlp.gate.weight_1" in load_file(shard)  # the file is in Baidu's layout
    params = []
    for weights in (load_file(shard).items(), ((name, t.numpy()) for name, t in hf.state_dict().items())):
        model = Ernie4_5_VLMoeForConditionalGeneration(hf.config)
        model.load_weights(weights)
        params.append(dict(model.named_parameters()))
    assert params[0].keys() == params[1].keys() and any("vision_moe.moe_statics" in n for n in params[0])
    for name, param in params[0].items():
        np.testing.assert_array_equal(param.numpy(), params[1][name].numpy(), err_msg=name)
    model = llm.llm_engine.engine_core.worker.model_runner.model
    with pytest.raises(NotImplementedError, match="videos"):
        model.embed_multimodal(np.zeros((32, 588), dtype=np.float32), np.array([[2, 4, 4]]))
