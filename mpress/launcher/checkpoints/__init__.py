"""A run's files on disk: checkpoints (saved and resumed through
`torch.distributed.checkpoint`, verified against their manifest before any is loaded),
one run per directory (locks on `checkpoint.dir` and `--run-dir`), and a checkpoint's
model exported for use elsewhere."""
