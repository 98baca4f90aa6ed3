"""Llama-family models and the loader that builds them from a model argument."""
from pagedllm.models.loader import ARCHITECTURES, get_model_class, load_model, resolve_model

__all__ = ["ARCHITECTURES", "get_model_class", "load_model", "resolve_model"]
