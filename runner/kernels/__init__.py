"""The runner's backend registry and kernel implementations (attention, linear, MoE, weight quantization).

Under ``runner`` rather than a top-level ``kernels``: that import name is Hugging Face's ``kernels`` distribution,
which transformers >= 5.25 requires (``tests/test_kernels_name.py``).
"""
