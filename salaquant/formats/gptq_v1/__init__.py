"""GPTQ v1: symmetric int4 / int8 codes packed in int32 words, fp16 group scales, as ``gptq_marlin`` loads them."""
