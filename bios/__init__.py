"""Bios: self-hostable LoRA fine-tuning."""

__version__ = "0.1.0"
