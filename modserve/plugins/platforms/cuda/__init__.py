"""The ``cuda`` platform: NVIDIA GPUs through torch's CUDA device."""
