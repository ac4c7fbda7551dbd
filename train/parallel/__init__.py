"""Parallelism, applied to the single-device model from outside: the device mesh that owns the process groups
(``mesh``), the order the strategies nest in and data parallelism (``parallelize``), and one module per
strategy: ``tensor_parallel`` (TP/SP), ``pipeline`` (PP), ``context_parallel`` (CP), ``expert_parallel`` (EP),
``deepspeed_engine`` (DeepSpeed's ZeRO as the second data-parallel engine)."""
