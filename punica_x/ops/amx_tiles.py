"""Whether the CPU SGMV kernels run bf16 segments of several rows on AMX tiles (csrc/sgmv/amx.h).

$PUNICA_X_SGMV_AMX:
- "auto" (default): on where this CPU, its OS and the kernel build give AMX-BF16 tiles (the
  avx512_bf16 build on an Intel Xeon of the 4th generation or later); where the CPU has them
  but Linux refuses the process their state, a warning names why and the vector kernels run.
- "1": on, and refused (RuntimeError) where there are none;
- "0": off (the vector kernels everywhere).
Anything else is refused by name. Measured on a lent Xeon with AMX (2 cores, SmolLM2-135M's
shape, bf16): an Identical decode step 0.956x with tiles (rounds 0.925-1.009), a launch
0.44-0.52x (benchmarks/results/amx/README.md, 2026-11-26).
"""

from __future__ import annotations

import logging

from punica_x.env import SGMV_AMX

log = logging.getLogger("punica_x.ops")
OFF, HARDWARE = 0, 1


def apply_setting(module) -> None:
    """Set the kernel module's AMX mode (module.sgmv_amx) from $PUNICA_X_SGMV_AMX."""
    value = SGMV_AMX.get().strip()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{SGMV_AMX.name} must be auto, 0 or 1, got {value!r}")
    if value == "0":
        module.sgmv_amx(OFF, 0)
        return
    if value == "auto" and not module.amx_available():
        return  # no tiles here: the vector kernels, as everywhere
    try:
        module.sgmv_amx(HARDWARE, 0)
    except RuntimeError as exc:
        if value == "1":
            raise RuntimeError(f"{SGMV_AMX.name}=1: {exc}") from exc
        log.warning("SGMV stays on the vector kernels: %s", exc)
