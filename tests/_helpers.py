"""Helpers the test files share: the TP sizes and dtype most tests use, and a free TCP port.
Imported as ``from _helpers import ...`` (pytest puts tests/, conftest.py's folder, on sys.path)."""
import socket

import torch

TP_SIZES = [1, 2, 4]
F64 = torch.float64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
