"""Questions users ask of the static model: the largest model per strategy (maxsize), ablations, the out-of-core sweeps, and plots."""
