#!/usr/bin/env bash
# Train with mpress on this machine: `mpress train` launches the ranks itself.
#   launch/train.sh [CONFIG] [NPROC] [--KEY VALUE ...]
# CONFIG: a configs/train/ name or YAML path (default: configs/train/gpt-tiny-mixed.yaml)
# NPROC: ranks, one process each (default: mpress train's: the config's num_stages, else
#        one per visible GPU, else 4; gpt-tiny-interleaved runs 2)
# --KEY VALUE: overrides of the config's keys, e.g. --steps 10 --optimizer.lr 1e-3
# Exit status: 0 done, 1 a runtime failure, 2 bad input (one line on stderr each).
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/train/gpt-tiny-mixed.yaml
if [[ $# -gt 0 && $1 != --* ]]; then config=$1; shift; fi
nproc=()
if [[ $# -gt 0 && $1 != --* ]]; then nproc=(--nproc-per-node "$1"); shift; fi
exec python3 -m mpress train --config "$config" "${nproc[@]}" "$@"
