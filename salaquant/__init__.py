"""salaquant: post-training quantization for MiniCPM-SALA.

Importing salaquant registers the SALA model with transformers' Auto classes (when a program first uses them:
``salaquant.model.auto_register``), so ``AutoModelForCausalLM.from_pretrained`` loads a SALA checkpoint.
"""

__version__ = "0.1.0"

from .model.auto_register import install as _install

_install()
