"""Checkpoints: reading HF safetensors into the model, building it on a device, writing random-weight checkpoints."""
