"""Helpers around Hugging Face formats: model resolution, configs, tokenizers, GGUF metadata."""
