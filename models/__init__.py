"""Pipeline adapters: each turns a model config into a loaded pipeline and runs batches of items.

``flux``: diffusers ``FluxPipeline`` (``models.flux.FluxEngine``); ``vllm``: vLLM (``models.vllm_stage.VLLMEngine``). See ``models.registry``.
"""
