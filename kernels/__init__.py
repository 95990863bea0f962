"""The runner's backend registry and kernel implementations (attention, linear, MoE).

Not Hugging Face's ``kernels`` distribution, which shares this import name: nothing here provides its API, and
diffusers/transformers availability probes must not take this package for it (``tests/test_kernels_name.py``).
"""
