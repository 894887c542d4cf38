"""Model loading: ``get_model(model_config, load_config)``."""

from fastdeploy.model_executor.model_loader.loader import get_model, get_weights_iterator, initialize_dummy_weights

__all__ = ["get_model", "get_weights_iterator", "initialize_dummy_weights"]
