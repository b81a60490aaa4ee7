"""Calibration: text to token samples, the layer-by-layer engine and its statistics, the fixed summation tree,
several processes under torchrun, host-memory checks, and ``salaquant calibrate``."""
