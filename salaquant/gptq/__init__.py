"""GPTQ W4A16: solver, plan, export in the GPTQ v1 layout (gptq_marlin)."""
