"""Upper bounds on what a config or a flag may ask for: one place, shared by the typed
configs (field metadata `max`) and the CLI flags (`mpress.config.loader.int_arg`).

A bound sits far above any real use and below where a value would make mpress do absurd
work (schedules, emulations and action lists grow with stages x microbatches; a
synthetic chain table with vocab x branching entries) or overflow a 64-bit count. Sizes
in bytes are bounded by `mpress.config.units.MAX_BYTES`.
"""

from __future__ import annotations

MAX_DEVICES = 1024
"""Devices in one server (hardware `num_devices`, `--devices`); pair tables grow as its square."""
MAX_STAGES = 1024
"""Pipeline stages (`num_stages`, `--stages`, `--ranks`)."""
MAX_MICROBATCHES = 4096
"""Microbatches per step (`num_microbatches`, `--microbatches`); every rank's action list,
the emulation and torch's schedule grow with it (1e9 ended in a SystemError after 45 s)."""
MAX_MICROBATCH_SIZE = 65536
"""Samples per microbatch (`microbatch_size`, `--microbatch-size`, tile `--batch`)."""
MAX_STEPS = 10**9
"""Optimizer steps and step counts (`steps`, `log_every`, `checkpoint.every_steps`)."""
MAX_SEED = 2**32 - 1
"""Seeds (numpy's and torch's generators take them; mpress derives per-rank seeds as seed x 1000 + rank)."""
MAX_LAYERS = 4096
"""Transformer blocks of a model."""
MAX_WIDTH = 2**20
"""Hidden, MLP and head counts of a model, and sequence length in tokens."""
MAX_VOCAB = 2**32
"""Vocabulary size (token files hold ids as uint32 at most)."""
MAX_BRANCHING = 2**16
"""Successors per token of the synthetic chain (its table has vocab x branching entries)."""
MAX_NVLINK_LINKS = 64
"""NVLink links between one GPU pair, or per GPU under NVSwitch (18 on H100)."""
MAX_LATENCY_S = 1.0
"""Fixed cost of one copy (microseconds in practice)."""
MIN_BANDWIDTH_GBPS = 1e-3
"""Slowest PCIe bandwidth a hardware file may state, GB/s (1 MB/s)."""
MAX_IMAGE_SIZE = 2**18
"""Side of a square image in pixels (`mpress tile --image-size`; whole-slide images are 10-20k)."""
MAX_ITERS = 10_000
"""Warm-up and timed iterations of a measured profile."""
MAX_FILE_BYTES = 4 * 2**20
"""Size of a config, plan, profile or HF config.json file read (4 MiB): checked before a
byte is parsed. A plan for gpt-20.4b on dgx1-v100 with 256 microbatches is 0.27 MB; a
100 MB file of comments took minutes to scan, a 100 MB list ended in a MemoryError."""
MAX_YAML_NODES = 100_000
"""Nodes (scalars, lists, mappings) of one YAML document, counted as it is composed and
before any value is built: that plan has under a thousand (its programs are strings); a
4 MB list of a million numbers took over a minute to compose."""
