"""Pure-PyTorch sources (torch, numpy, safetensors, tokenizers only): the fp32 references."""

__all__: list[str] = []
