"""The training step and its variants: the step recorded in a CUDA graph (``cuda_graphs=True``),
the DDP/FSDP wrapper a step trains under, and the clock of where a step's time goes.
"""
