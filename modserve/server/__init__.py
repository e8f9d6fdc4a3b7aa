"""The OpenAI-compatible HTTP server behind ``modserve serve``."""
