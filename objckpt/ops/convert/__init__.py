"""Conversion: safetensors exports of committed checkpoints, and imports back."""
