"""Hardware: the server model (presets and detection), several servers (cluster), what a GPU process takes besides its tensors (reserve, probe).

Imports mpress.config.loader and mpress.errors only."""
