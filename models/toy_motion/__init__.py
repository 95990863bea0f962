"""toy_motion: a small Wan-architecture text-to-video model trained on procedurally drawn moving shapes, and its
oracle.

``data``: the deterministic captioned-clip generator; ``oracle``: reads a clip back into (colour, shape,
direction); ``train``: the reproducible training script (run on a GPU); ``weights/``: the trained pipeline.
"""
