"""IndexMem's trainable parts, one :class:`IndexMemLayer` per decoder layer, held in an :class:`IndexMemBank`.

Per layer (``D`` hidden size, ``Hq`` / ``Hk`` query / KV heads, ``d`` head size):

* **Indexer** - ``s_j = MLP(h_j)`` ``[Hk]``: a query-agnostic importance score per KV head of each token from
  the attention input ``h_j`` (after the layer's input norm), computed once, when the token enters the cache.
* **Latent memory** - per KV head a linear-attention state of the evicted entries, ``M = sum_j phi(k_j) v_j^T``
  ``[d, d]`` and ``z = sum_j phi(k_j)`` ``[d]`` (``phi = elu + 1``; keys as cached, after RoPE): order-invariant
  sums, updated online at every eviction, parameter-free.
* **Residual readout** - for query head ``h`` of the group, ``u = phi(q)^T M / (phi(q)^T z + eps)`` ``[d]``,
  ``r = g_h(x) * (u W_h)``, added to the head's attention output before ``o_proj``. ``W_h`` ``[d, d]`` starts as
  the identity (``u`` is then the linear-attention estimate of the evicted entries' output); the gate is
  ``g_h(x) = tanh(a_h) sigmoid(x w_h + b_h)`` with ``a_h = 0`` at initialisation, so an untrained bank adds
  exactly nothing (eviction alone) and the readout opens as training finds it useful.

The bank is saved as ``indexmem.safetensors`` + ``indexmem.json`` (shapes and settings) in a folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from litctx_common.io import atomic_path

__all__ = ["BankShape", "IndexMemLayer", "IndexMemBank", "feature_map", "memory_token_equivalent", "WEIGHTS", "SETTINGS"]

WEIGHTS = "indexmem.safetensors"
SETTINGS = "indexmem.json"


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """``elu(x) + 1`` (positive features of the linear-attention memory), in float32."""
    return F.elu(x.float()) + 1.0


def memory_token_equivalent(head_dim: int, value_dim: Optional[int] = None) -> int:
    """Tokens of KV cache one memory state costs per KV head: ``(d * dv + d) / (d + dv)`` floats-per-token,
    rounded up (``d = dv = 64``: 33 tokens)."""
    dv = head_dim if value_dim is None else value_dim
    return -(-(head_dim * dv + head_dim) // (head_dim + dv))


@dataclass(frozen=True)
class BankShape:
    """The model dimensions a bank is built for (read from a Hugging Face config)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "BankShape":
        heads = int(config.num_attention_heads)
        return cls(int(config.num_hidden_layers), int(config.hidden_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads),
                   int(getattr(config, "head_dim", None) or config.hidden_size // heads))


class IndexMemLayer(nn.Module):
    """One layer's indexer, readout projection and gate (see the module docstring)."""

    def __init__(self, shape: BankShape, indexer_hidden: int = 64, gate_bias: float = 0.0) -> None:
        super().__init__()
        d, hq = shape.head_dim, shape.num_heads
        self.indexer = nn.Sequential(nn.Linear(shape.hidden_size, indexer_hidden), nn.GELU(),
                                     nn.Linear(indexer_hidden, shape.num_kv_heads))
        self.readout = nn.Parameter(torch.eye(d).repeat(hq, 1, 1))  # [Hq, d, d]
        self.gate = nn.Linear(shape.hidden_size, hq)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, float(gate_bias))
        self.gate_scale = nn.Parameter(torch.zeros(hq))  # a_h: tanh(0) = 0, the readout starts closed
        self.group = hq // shape.num_kv_heads

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Indexer scores ``[B, Hk, N]`` of hidden states ``[B, N, D]``."""
        return self.indexer(hidden.float()).transpose(1, 2)

    def gate_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """``g [B, Hq, N]`` for hidden states ``[B, N, D]``."""
        return (torch.tanh(self.gate_scale)[:, None] * torch.sigmoid(self.gate(hidden.float())).transpose(1, 2))

    def read(self, q: torch.Tensor, mem: torch.Tensor, norm: torch.Tensor, hidden: Optional[torch.Tensor],
             eps: float = 1e-6) -> torch.Tensor:
        """Residual ``r [B, Hq, Nq, d]`` for queries ``q [B, Hq, Nq, d]`` from ``mem [B, Hk, d, dv]`` and ``norm
        [B, Hk, d]``; ``hidden [B, Nq, D]`` feeds the gate (None: the gate's constant part, ``sigmoid(b)``)."""
        b, hq, nq, d = q.shape
        hk = mem.shape[1]
        phi = feature_map(q).view(b, hk, hq // hk, nq, d)
        num = torch.matmul(phi, mem.unsqueeze(2))  # [B, Hk, g, Nq, dv]
        den = (phi * norm[:, :, None, None, :]).sum(-1, keepdim=True) + eps
        u = (num / den).reshape(b, hq, nq, -1)
        r = torch.matmul(u, self.readout.unsqueeze(0))  # [B, Hq, Nq, dv]
        if hidden is None:
            g = (torch.tanh(self.gate_scale) * torch.sigmoid(self.gate.bias)).view(1, hq, 1)
        else:
            g = self.gate_values(hidden)
        return r * g.unsqueeze(-1)


class IndexMemBank(nn.Module):
    """Every layer's :class:`IndexMemLayer` (``layers[l]``) plus the settings it was built with."""

    def __init__(self, shape: BankShape, indexer_hidden: int = 64, gate_bias: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.settings = {"indexer_hidden": int(indexer_hidden), "gate_bias": float(gate_bias)}
        self.layers = nn.ModuleList(IndexMemLayer(shape, indexer_hidden, gate_bias) for _ in range(shape.num_layers))

    @classmethod
    def for_model(cls, model: nn.Module, **settings: Any) -> "IndexMemBank":
        return cls(BankShape.of(model.config), **settings)

    def check_model(self, model: nn.Module) -> None:
        """Raise ``ValueError`` unless the bank fits ``model``'s dimensions."""
        have = BankShape.of(model.config)
        if have != self.shape:
            raise ValueError(f"this IndexMem bank was trained for {asdict(self.shape)}, the model has {asdict(have)}")

    def parameter_count(self) -> Dict[str, int]:
        """Parameters of the indexers and of the readouts / gates."""
        idx = sum(p.numel() for layer in self.layers for p in layer.indexer.parameters())
        total = sum(p.numel() for p in self.parameters())
        return {"indexer": idx, "memory_readout": total - idx, "total": total}

    def indexer_flops_per_token(self) -> int:
        """Multiply-adds x 2 of the indexer MLPs for one token (all layers)."""
        h, d, hk = self.settings["indexer_hidden"], self.shape.hidden_size, self.shape.num_kv_heads
        return 2 * self.shape.num_layers * (d * h + h * hk)

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Path | str) -> Path:
        """Write ``indexmem.safetensors`` and ``indexmem.json`` into ``folder`` (atomically, as a whole folder)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        with atomic_path(folder) as tmp:
            tmp.mkdir(parents=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(tmp / WEIGHTS))
            (tmp / SETTINGS).write_text(json.dumps({"shape": asdict(self.shape), **self.settings}, indent=1))
        return folder

    @classmethod
    def load(cls, folder: Path | str) -> "IndexMemBank":
        """A bank saved by :meth:`save`; a folder without its files is a ``FileNotFoundError`` naming them."""
        from safetensors.torch import load_file

        folder = Path(folder)
        missing = [n for n in (WEIGHTS, SETTINGS) if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} is not an IndexMem folder: missing {', '.join(missing)} (train one with "
                                    f"python -m recipes.fit --recipe indexmem_smollm2)")
        meta = json.loads((folder / SETTINGS).read_text())
        bank = cls(BankShape(**meta["shape"]), indexer_hidden=meta["indexer_hidden"], gate_bias=meta["gate_bias"])
        bank.load_state_dict(load_file(str(folder / WEIGHTS)))
        return bank
