"""Engines: each runs one stage of a run (loading, call arguments and model knowledge) behind the protocol of
:mod:`models.base`, looked up by ``model.engine`` in :mod:`models.registry`.

* diffusion: :class:`models.pipelines.PipelineEngine` (on :class:`models.diffusers_engine.DiffusersEngine`) drives
  every diffusers family declared by a :class:`models.family.FamilySpec` (``models/flux.py``, ``sd3``, ``qwen_image``,
  ``wan``, ``hidream``, ``ltx2``, ``flux2``, ``zimage``, ``hunyuanvideo15``; registered in
  :data:`models.registry.FAMILIES`); :mod:`models.snapshot` builds a family's components and embedded snapshot,
  :mod:`models.tokenizer_kinds` its tokenizers; its features are passes (:mod:`models.passes`), each in its own
  module (``lora``, ``cache``, ``memory``, ``context_parallel``, ``conditioning``, ``compile``, ``backend_passes``,
  ``prompt_tokens``, ``denoiser_evidence``), listed in ``DiffusersEngine.PASSES``;
* autoregressive: :mod:`models.vllm` (``model.engine=vllm``, :class:`models.vllm.engine.VLLMEngine`);
* the trained toys (``toy_shapes``, ``toy_motion``, ``toy_edit``): their weights, data and oracles.
"""
