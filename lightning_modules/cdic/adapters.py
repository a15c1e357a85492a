"""Token-conditional LoRA: low-rank adapters on a frozen model's linear layers, active only at chosen positions.

Compressed-context methods (CCM, C-DIC) let special compression tokens read the context through adapted
projections while every other token runs the base model unchanged. :class:`MaskedLoRA` keeps the adapters in
its own module (names ``layers.<i>.<target>.A`` / ``.B``, so the model's state dict and ``save_pretrained`` are
untouched) and adds them through forward hooks on the target linears:

    y = W x + mask * (alpha / r) * B (A x)

``mask`` ``[B, n]`` (bool or float) is set for one forward with :meth:`MaskedLoRA.active`; outside that block the
hooks add nothing. ``B`` starts at zero, so a fresh adapter is the identity.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from lightning_modules.llm.model.surgery import SurgeryError, decoder_layers

__all__ = ["MaskedLoRA"]


class _Pair(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)  # kaiming-uniform(a=sqrt(5)) of a [rank, d_in] weight, as nn.Linear
        self.A = nn.Parameter(torch.empty(rank, d_in).uniform_(-bound, bound, generator=generator))
        self.B = nn.Parameter(torch.zeros(d_out, rank))


class MaskedLoRA(nn.Module):
    """LoRA pairs on ``targets`` (attribute paths inside each decoder layer, e.g. ``self_attn.q_proj``) of every
    decoder layer of ``model``; hooks are attached by :meth:`attach` and removed by :meth:`detach`."""

    def __init__(self, model: nn.Module, targets: Sequence[str], rank: int, alpha: float, seed: int = 0) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"MaskedLoRA: rank={rank} must be >= 1")
        _, layers = decoder_layers(model)
        g = torch.Generator().manual_seed(seed)
        self.targets = list(targets)
        self.rank, self.alpha = int(rank), float(alpha)
        self.layers = nn.ModuleList()
        for i, layer in enumerate(layers):
            pairs = nn.ModuleDict()
            for t in self.targets:
                lin = self._find(layer, t, i)
                pairs[t.replace(".", "__")] = _Pair(lin.in_features, lin.out_features, rank, g)
            self.layers.append(pairs)
        ref = next(model.parameters())
        self.to(device=ref.device, dtype=ref.dtype)
        self._mask: Optional[torch.Tensor] = None
        self._handles: List[Any] = []

    @staticmethod
    def _find(layer: nn.Module, path: str, index: int) -> nn.Linear:
        mod: Any = layer
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                raise SurgeryError(f"MaskedLoRA: decoder layer {index} has no {path!r} (targets are attribute "
                                   f"paths inside a decoder layer, e.g. self_attn.q_proj)")
        if not isinstance(mod, nn.Linear):
            raise SurgeryError(f"MaskedLoRA: {path!r} of decoder layer {index} is a {type(mod).__name__}, not a "
                               f"Linear")
        return mod

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def attach(self, model: nn.Module) -> "MaskedLoRA":
        """Hook the adapters into ``model``'s target linears (idempotent)."""
        if self._handles:
            return self
        _, layers = decoder_layers(model)
        if len(layers) != len(self.layers):
            raise SurgeryError(f"MaskedLoRA: built for {len(self.layers)} decoder layers, the model has {len(layers)}")
        for i, layer in enumerate(layers):
            for t in self.targets:
                pair = self.layers[i][t.replace(".", "__")]
                self._handles.append(self._find(layer, t, i).register_forward_hook(self._hook(pair)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, pair: _Pair) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            mask = self._mask
            if mask is None:
                return out
            x = args[0]
            if tuple(mask.shape) != tuple(x.shape[:-1]):
                raise ValueError(f"MaskedLoRA: the active mask has shape {list(mask.shape)}, the layer input "
                                 f"{list(x.shape)} (the mask must be [B, n] of the forward it was set for)")
            delta = (x @ pair.A.t()) @ pair.B.t()
            return out + delta * (mask.to(out.dtype).unsqueeze(-1) * self.scale)

        return hook

    @contextlib.contextmanager
    def active(self, mask: Optional[torch.Tensor]) -> Iterator[None]:
        """Adapters on at ``mask [B, n]`` for the forwards inside the block (None: off)."""
        previous, self._mask = self._mask, mask
        try:
            yield
        finally:
            self._mask = previous

    # ------------------------------------------------------------------ persistence
    def save(self, folder: Any) -> Path:
        """``adapters.safetensors`` + ``adapters.json`` (targets, rank, alpha) in ``folder``, written atomically."""
        from safetensors.torch import save_file

        from litctx_common.io import atomic_path, atomic_write_text

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_path(folder / "adapters.safetensors") as tmp:
            save_file(tensors, str(tmp))
        atomic_write_text(folder / "adapters.json", json.dumps(self.spec(), indent=2))
        return folder

    def spec(self) -> Dict[str, Any]:
        return {"targets": self.targets, "rank": self.rank, "alpha": self.alpha, "layers": len(self.layers)}

    def load(self, folder: Any) -> "MaskedLoRA":
        """Load weights saved by :meth:`save`; a folder of other targets / rank / depth is refused by name."""
        from safetensors.torch import load_file

        folder = Path(folder)
        meta_path = folder / "adapters.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder}: no adapters.json (expected a folder written by MaskedLoRA.save)")
        meta = json.loads(meta_path.read_text())
        if meta != self.spec():
            diff = {k: (meta.get(k), v) for k, v in self.spec().items() if meta.get(k) != v}
            raise ValueError(f"{folder}: adapters saved as {diff} (saved, expected) do not fit this model")
        self.load_state_dict(load_file(str(folder / "adapters.safetensors")))
        return self
