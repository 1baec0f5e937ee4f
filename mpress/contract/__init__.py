"""The contract between the halves: the plan and its actions, how tensors and layers are named, op-level recompute, the plan check, the live-byte count and the trace format both halves write.

Imports only mpress.config.loader, mpress.hardware.server and mpress.errors; never a half (static, runtime, d2d)."""
