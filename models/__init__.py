"""Pipeline adapters: each turns a model config into a loaded pipeline and runs batches of items.

``flux``: diffusers ``FluxPipeline`` (``models.flux.FluxAdapter``).
"""
