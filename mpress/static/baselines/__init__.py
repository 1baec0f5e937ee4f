"""Baselines users reach for instead of mpress, planned by the same static model: DeepSpeed ZeRO-Offload/Infinity (and their channel model, the host Adam step) and Megatron's selective recompute."""
