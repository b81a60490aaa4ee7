"""NVFP4 (E2M1 weights, FP8 E4M3 block scales, fp32 global scale) in NVIDIA ModelOpt's export layout."""
