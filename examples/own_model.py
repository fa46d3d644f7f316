"""A model of your own for ``tplayers verify --model``: nanoGPT-style attention (one fused ``c_attn``,
head count and width read from attributes) and an MLP, with its plan.

    tplayers verify --model examples.own_model:build --plan examples.own_model:PLAN --tp 1,2,4

``build()`` returns a tiny dense instance and an example input; verify calls it under the same seed
on every rank, parallelizes it with the plan and audits each region against its dense twin.
``WRONG_PLAN`` declares the fused ``c_attn`` as a plain ``"column"``: verify fails and says why.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tplayers import Plan
from tplayers.convert import FusedQKV


class Attention(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, t, c)
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))  # (b, nh, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.n_embd))


class Block(nn.Module):
    def __init__(self, n_embd: int = 32) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(n_embd), Attention(n_embd), nn.LayerNorm(n_embd)
        self.fc, self.proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class Net(nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build():
    return Net(), torch.randn(2, 8, 32)


_LAYERS = {"blocks.*.attn.c_attn": FusedQKV(heads="n_head"), "blocks.*.attn.c_proj": "row",
           "blocks.*.fc": "column", "blocks.*.proj": "row"}
PLAN = Plan(_LAYERS, divide_attrs={"blocks.*.attn": ("n_head", "n_embd")})
WRONG_PLAN = Plan({**_LAYERS, "blocks.*.attn.c_attn": "column"}, divide_attrs={"blocks.*.attn": ("n_head", "n_embd")})
