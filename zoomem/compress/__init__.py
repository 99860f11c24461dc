"""Lossy storage of saved activations: per-group stochastic-rounding quantization and sensitivity estimation."""

from .quantize import (BITS, GROUP_SIZE, Quantized, dequantize, quantize, quantized_nbytes, seconds_per_byte,
                       seconds_per_call)
from .sensitivity import Sensitivity, empirical_variance, estimate_sensitivity, perturbed_grads, predicted_variance

__all__ = [
    "BITS",
    "GROUP_SIZE",
    "Quantized",
    "Sensitivity",
    "dequantize",
    "empirical_variance",
    "estimate_sensitivity",
    "perturbed_grads",
    "predicted_variance",
    "quantize",
    "quantized_nbytes",
    "seconds_per_byte",
    "seconds_per_call",
]
