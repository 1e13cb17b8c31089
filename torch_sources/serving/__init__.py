"""vLLM-shaped paged-attention serving engine in pure PyTorch (the original the JAX engine mirrors).

Host bookkeeping (config, request, block_pool, kv_cache_manager, scheduler, input_batch) is plain Python.
Import submodules directly, e.g. `from torch_sources.serving.scheduler import Scheduler`.
"""
