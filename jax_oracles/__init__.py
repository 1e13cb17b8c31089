"""JAX/Flax oracle mirror of torch_sources/models and torch_sources/training (torch-free)."""

__all__: list[str] = []
