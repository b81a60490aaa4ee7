"""Triton kernels (imported as ``salaquant.kernels``), each beside its PyTorch reference."""
