"""The byte formats salaquant writes, one package each: how tensors are packed and unpacked, the
``quantization_config`` the serving engines read, reading a linear back as a dense weight, and the checker of
what SGLang / vLLM need of a checkpoint. The solvers (``salaquant.gptq``, ``salaquant.nvfp4``) produce weights;
export, the checker, the model loader and the runtime read and write bytes only through these modules.

* ``gptq_v1``: GPTQ v1 (symmetric int4 / int8, ``gptq_marlin``): ``packing``, ``dynamic`` (per-module rules),
  ``config``, ``read``, ``check``.
* ``modelopt_nvfp4``: ModelOpt NVFP4 (``modelopt_fp4``): ``numerics`` (codes, scales, packing, read back),
  ``config``, ``check``.
* ``check``: ``check_checkpoint``, which checks a folder against its ``config.json`` and hands it to its format's
  checker; ``report``: what a checker returns or raises.
"""
