"""The cache, engine-agnostic (torch and numpy only): ``cache`` (requests' block maps, capture,
read, lifecycle), ``page_pool`` (page ids: free, published by block hash, pins, eviction order),
``request_slots`` (the slot-indexed arrays the batched calls vectorise over), ``batch_size``
(where plain Python over a batch beats array passes) and ``checks`` (argument checks). Its vLLM adapter is the ``vllm`` subpackage, the only part that imports vLLM.
"""
