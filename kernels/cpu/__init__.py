"""kernels/cpu."""
