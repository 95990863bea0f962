"""toy_edit: a small FLUX.1 Kontext-architecture editing model trained on pairs of toy_shapes images, and its oracle.

``data``: the instruction grammar, the deterministic (input, instruction, target) pair generator and the builtin rows
(input images drawn by ``models.toy_shapes.data``); ``oracle``: reads an output back with the toy_shapes oracle and
checks the instructed attribute against the instruction and every other attribute against the input; ``train``: the
reproducible training script (run on a GPU); ``weights/``: the trained ``FluxKontextPipeline`` (its VAE, text encoders
and tokenizers are toy_shapes' own, copied byte for byte; only the transformer is trained here).
"""
