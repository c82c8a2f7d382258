"""Kernels: Triton on GPU, plain torch (tandem_kernels.reference) on CPU, behind one set of functions."""
