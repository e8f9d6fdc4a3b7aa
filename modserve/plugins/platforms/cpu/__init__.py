"""The ``cpu`` platform: its linear method and C++ kernels (``csrc/``), host-memory tuning."""
