"""Kernels with documented wrappers: SGMV (multi-LoRA: sgmv.py, its weights in
sgmv_weights.py), the dense and fused CPU layers (dense.py, fused.py), the ISA levels and the
kernel build (isa.py, _build.py), autotuning (autotune.py) and the backend registry
(registry.py). Import from the modules; this package imports nothing, so importing one of them
(e.g. isa from config.py) loads no other."""
