"""Hybrid runtime: load a bf16, GPTQ or NVFP4 SALA checkpoint and run it with quantized linears and kernels."""
