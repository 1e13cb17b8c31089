"""JAX serving engine: the mirror of torch_sources/serving (see docs/CONTRACTS.md)."""

__all__: list[str] = []
