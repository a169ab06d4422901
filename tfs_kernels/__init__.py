"""Triton kernels, each registered as a torch custom op (namespace ``tfs``) beside its plain-torch reference."""
