"""kernels/triton."""
