"""The vLLM adapter of the cache: the worker connector (``vllm_worker``), the plugin vLLM loads
(``vllm_plugin``) and the CUDA stream its row copies run on (``side_stream``).

Importing this package imports no vLLM; its modules do.
"""
