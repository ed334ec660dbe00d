"""The embedded engine's native low-bit kernels: the linears per format (``linear``), the C library that computes
them (``native``), and the load-time speed check (``speed_check``)."""
