"""Fused-tiled execution (SFT): train conv pipelines whose single activations exceed the
memory budget, by running segments of layers tile by tile with halos and recomputing
them tile by tile in backward. `TiledSequential` is the entry point."""
