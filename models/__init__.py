"""Engines: each runs one stage of a run (a model family's loading, call arguments and model knowledge) behind the
protocol of :mod:`models.base`, looked up by ``model.adapter`` in :mod:`models.registry`.

``flux``: diffusers ``FluxPipeline`` (:class:`models.flux.FluxEngine`, on :class:`models.diffusers_engine.DiffusersEngine`);
``vllm``: autoregressive models through vLLM (:class:`models.vllm.engine.VLLMEngine`).
"""
