"""The torchrun launcher's parts (`mpress.train` is its entry): planning at start-up,
the job with its peer pools, checkpoints, reports and the control group.

The launcher is the one place that sees both halves and the D2D run-time part: it may
plan (static), build the job (runtime) and wire the peer pools into it (d2d).
"""
