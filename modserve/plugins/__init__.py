"""Built-in plugins: KV allocators, schedulers (later: grammar backends, proposers)."""
