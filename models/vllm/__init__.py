"""The vLLM side of the runner (``model.engine=vllm``): autoregressive models and AR stages of pipelines.

Modules (imported on use: ``vllm`` itself loads only when an engine is prepared):

* :mod:`models.vllm.engine`: :class:`~models.vllm.engine.VLLMEngine`, the engine protocol of ``models.base`` for
  one AR stage (checks, backends, rows, load, generate, records, evidence).
* :mod:`models.vllm.rows`: the AR dataset row (:data:`~models.vllm.rows.AR_ROW`, a spec of the one row driver
  ``runner.core.dataset.validate_rows``) and ``model.sampling`` checks.
* :mod:`models.vllm.adapter`: :class:`~models.vllm.adapter.VLLMAdapter`, one ``vllm.LLM`` with the backends and
  sampling it was asked for.
* :mod:`models.vllm.names`: vLLM's backend names, their normalization and which of them vLLM honours where.
* :mod:`models.vllm.observation`: what the worker built and ran (the AR evidence).
"""
