"""Attention kernels (reference PyTorch, fast CPU path, Triton) behind one public op."""
