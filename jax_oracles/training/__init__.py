"""JAX/optax twins of torch_sources/training (LLaMA-Factory-shaped SFT): same modules, same public names."""

__all__ = ["template", "processor", "collator", "lora", "optimizer", "loss", "sft"]
