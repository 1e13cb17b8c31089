"""Flax Linen twins of torch_sources/models, one file per family."""

__all__: list[str] = []
