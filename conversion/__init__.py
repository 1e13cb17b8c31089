"""Torch-free checkpoint conversion: HF safetensors (read with numpy) -> Flax param trees."""

__all__: list[str] = []
