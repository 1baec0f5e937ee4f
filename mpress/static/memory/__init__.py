"""The memory model: bytes per device from profile, partition, schedule and hardware; a stage layer by layer; the breakdown at the peak; pinned host memory per stage."""
