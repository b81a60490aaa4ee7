"""ModelOpt NVFP4: E2M1 codes two per byte, FP8 E4M3 scales per 16 weights, an fp32 global scale per tensor."""
