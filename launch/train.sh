#!/usr/bin/env bash
# Launch mpress training under torchrun on this machine.
#   launch/train.sh [CONFIG] [NPROC]
# CONFIG: a configs/train/ name or YAML path (default: gpt-tiny-mixed)
# NPROC: processes, one per pipeline rank (default: 4; gpt-tiny-interleaved uses 2)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/train/gpt-tiny-mixed.yaml}
nproc=${2:-4}
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m mpress.train --config "$config"
