"""Spiking neurons in multi-step mode (``[T, B, ...]``) for the Timestep-Scalable (TS) neuron study: LIF and
the TS neuron (long-term memory reconsolidation + periodic temporal forgetting), surrogate gradients, and a
fused multi-step LIF (one autograd node over all T instead of one per step)."""

from lightning_modules.spiking.neurons import LIF, LIFConfig, TSConfig, TSNeuron
from lightning_modules.spiking.surrogate import SURROGATES, atan_surrogate, sigmoid_surrogate, spike

__all__ = ["LIF", "LIFConfig", "TSNeuron", "TSConfig", "spike", "SURROGATES", "sigmoid_surrogate",
           "atan_surrogate"]
