"""The floating-point dtypes tplayers' tools accept by name (``--dtype``, ``BenchConfig.dtype``): one table."""
import torch

__all__ = ["DTYPES"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
