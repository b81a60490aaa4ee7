"""Architecture-aware SmoothQuant: per-channel scales folded into norms / up_proj rows and consumer columns."""
