"""Multimodal inputs (vLLM's ``vllm.multimodal``): media loading, hashing, HF processing, runner state.

The API process fetches and decodes images (:mod:`.media`), runs the model's Hugging Face image
processor and expands each image placeholder token to the image's token count
(:mod:`.processing`), and hashes each image (:mod:`.hasher`). The engine request carries the
processed tensors as :class:`~fastdeploy.multimodal.inputs.MultiModalFeatureSpec`; the prefix
cache mixes each image's hash into the blocks its placeholders cover, and the model runner
(:mod:`.runner`) runs the vision tower once per image (the encoder cache) and supplies the
3-D M-RoPE positions.
"""
