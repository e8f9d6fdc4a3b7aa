"""Built-in plugins, one folder per kind: models, platforms, kv_allocators, schedulers, grammars, proposers."""
