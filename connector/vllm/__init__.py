"""The vLLM adapter of the cache: the worker connector (``worker``), the plugin vLLM loads
(``plugin``), what each supported vLLM release needs (``versions``) and the CUDA stream the row
copies run on (``side_stream``).

Importing this package imports no vLLM; its modules do.
"""
