"""gpuos-tools: small Unix-style commands for GPU processes (trace, predict, checkpoint, schedule)."""

__version__ = "0.1.0"
