"""Configuration: typed YAML loading, command-line overrides, limits, units, setting and model presets, and the shared vocabulary (techniques, schedules, strategies).

A leaf: imports nothing of mpress but mpress.errors."""
