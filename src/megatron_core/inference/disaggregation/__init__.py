"""Prefill/decode disaggregation: moving requests' KV caches and Mamba states between inference shards of
different parallel layouts (Megatron-Core 0.19's ``inference.disaggregation``).

:mod:`.kv_reshard` and :mod:`.mamba_reshard` plan the moves from the layouts alone (every rank computes the same
plan); :mod:`.cache_views` finds the tensors a plan reads and writes in this library's dynamic context, and
:mod:`.execute` carries the moves out with point-to-point sends. Megatron-Core 0.19 ships the planners only.
"""
