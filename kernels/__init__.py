"""Kernels: Triton on GPU, plain torch (kernels.reference) on CPU, behind one set of functions."""
