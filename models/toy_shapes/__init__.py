"""toy_shapes: a small FLUX-architecture model trained on procedurally drawn coloured shapes, and its oracle.

``data``: the deterministic captioned-image generator; ``oracle``: reads an image back into (colour, shape,
position); ``train``: the reproducible training script (run on a GPU); ``weights/``: the trained pipeline.
"""
