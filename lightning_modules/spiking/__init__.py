"""Spiking neurons in multi-step mode (``[T, B, ...]``) for the Timestep-Scalable (TS) neuron study: LIF and
the TS neuron (long-term memory reconsolidation + periodic temporal forgetting), surrogate gradients, and a
fused multi-step LIF (one autograd node over all T instead of one per step).

The names below load on first access (PEP 562), so ``lightning_modules.spiking.spec`` stays torch-free."""

from importlib import import_module
from typing import Any

__all__ = ["LIF", "LIFConfig", "TSNeuron", "TSConfig", "spike", "SURROGATES", "sigmoid_surrogate",
           "atan_surrogate"]

_HOME = {"LIF": "neurons", "LIFConfig": "neurons", "TSNeuron": "neurons", "TSConfig": "neurons",
         "spike": "surrogate", "SURROGATES": "surrogate", "sigmoid_surrogate": "surrogate",
         "atan_surrogate": "surrogate"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(f"lightning_modules.spiking.{_HOME[name]}"), name)
    raise AttributeError(f"module 'lightning_modules.spiking' has no attribute {name!r}")
