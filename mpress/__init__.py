"""mpress: train models larger than GPU memory with memory-compacting pipeline parallelism."""

__version__ = "0.1.0"
