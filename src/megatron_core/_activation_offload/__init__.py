"""Fine-grained activation offloading (Megatron-Core's ``pipeline_parallel.fine_grained_activation_offload``).

The code lives here, below ``transformer`` and ``pipeline_parallel``, because both use it (the layers open
offload groups, the schedules reset the manager) and it imports nothing of ours but ``device`` and ``_nvtx``;
``megatron_core.pipeline_parallel.fine_grained_activation_offload`` re-exports its public names.

- :mod:`.streams`: CUDA streams and events, or their host-memory stand-ins on CPU;
- :mod:`.tensor_pool`: ``OffloadTensorPool``, host buffers reused by ``(shape, dtype)``;
- :mod:`.chunk_handler`: ``OffloadTensorGroup`` and ``ChunkOffloadHandler`` (one model chunk's groups);
- :mod:`.manager`: ``PipelineOffloadManager``, the singleton that orders chunks across micro-batches and
  virtual stages and applies the offload policy after the first iteration;
- :mod:`.interface`: the autograd markers and ``FineGrainedActivationOffloadingInterface`` the layers call;
- :mod:`.summary`: ``print_offload_summary_table``.
"""
