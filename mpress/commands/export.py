"""`mpress export CHECKPOINT_DIR --out DIR`: a trained model out of an mpress checkpoint.

A Hugging Face job's checkpoint becomes a transformers model folder (config.json +
model.safetensors under the original parameter names, a tied weight once), which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads; a preset's or a user
module's becomes one model.safetensors of the full state dict keyed by module path plus
mpress_model.json (the model's config). CHECKPOINT_DIR is `checkpoint.dir` (its newest
complete step is exported) or one step folder of it. See `mpress/launcher/checkpoints/export.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mpress.commands.flags import EXIT_STATUS, HelpFormatter
from mpress.errors import UserError
from mpress.launcher.checkpoints.export import export_checkpoint

EPILOG = """\
examples:
    mpress train --config train.yaml --checkpoint.dir ckpt
    mpress export ckpt --out gpt2-trained          # the newest complete step
    mpress export ckpt/step000079 --out gpt2-step79
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('gpt2-trained')"

""" + EXIT_STATUS


def register(subparsers: Any) -> None:
    """Add the `export` subcommand to the `mpress` parser."""
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's model as safetensors (transformers' layout for HF models)",
        description="Write the model of an mpress checkpoint as safetensors: for a Hugging Face model a folder "
                    "transformers' from_pretrained loads, else the full state dict keyed by module path.",
        epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="checkpoint.dir of a run (its newest complete step) or one stepNNNNNN folder of it")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (created)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; one line on success, a one-line error (exit status 2) otherwise."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file, not a directory")
    try:
        folder, what = export_checkpoint(Path(args.checkpoint), out)
    except OSError as exc:
        raise UserError(f"--out: cannot write {out}: {exc.strerror}") from None
    print(f"mpress export: step {folder.name} -> {out}: {what}")
    return 0
