"""LLaMA-Factory-shaped SFT in pure PyTorch: template, processor, collator, lora, optimizer, loss, sft."""

__all__ = ["template", "processor", "collator", "lora", "optimizer", "loss", "sft"]
