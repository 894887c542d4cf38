"""No downloads: the 'downloaded' model is the name itself; the server maps it to the default model."""


def download_weights_from_hf(model_name_or_path, *args, **kwargs):
    return model_name_or_path
