"""Stage one through vLLM: hidden states captured inside a vLLM engine and turned into our precompute shards.

The modules here that vLLM's own processes import (`vllm_connector`, `vllm_run`, and the pure `layers`, `book`,
`spool` they use) import only the standard library, torch, safetensors and vLLM, never the rest of the package:
vLLM runs in its own environment, where our dependencies are not installed. This `__init__` imports nothing.
"""
