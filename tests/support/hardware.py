"""Hardware figures typed in for tests, independently of configs/hardware/."""

# The DGX-1V link matrix as `nvidia-smi topo -m` shows it (DESIGN.md), typed in here
# independently of configs/hardware/dgx1-v100.yaml.
DGX1_LINKS = [
    [0, 1, 1, 2, 2, 0, 0, 0],
    [1, 0, 2, 1, 0, 2, 0, 0],
    [1, 2, 0, 2, 0, 0, 1, 0],
    [2, 1, 2, 0, 0, 0, 0, 1],
    [2, 0, 0, 0, 0, 1, 1, 2],
    [0, 2, 0, 0, 1, 0, 2, 1],
    [0, 0, 1, 0, 1, 2, 0, 2],
    [0, 0, 0, 1, 2, 1, 2, 0],
]
