"""salaquant: post-training quantization for MiniCPM-SALA."""

__version__ = "0.1.0"
