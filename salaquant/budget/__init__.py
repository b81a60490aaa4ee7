"""Mixed precision under a size budget: each unit of linears gets one of its options (4-bit, 8-bit, bf16; or
NVFP4, bf16) so that the export fits the budget and the measured damage is least (``size``: the budget and the
bytes of each option, ``measure``: the damage, ``solver``: the choice)."""
