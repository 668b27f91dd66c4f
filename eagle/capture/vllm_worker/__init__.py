"""Files that run inside vLLM's own venv, never imported by eagle (`capture.backend=vllm`).

`eagle_vllm_worker.py` is the worker script `eagle.capture.vllm_engine` starts with the engine's
python; `eagle_vllm_connector.py` is the KV connector module vLLM's processes import by name (this
folder is put on their PYTHONPATH). Both import only vLLM, torch, safetensors and the standard
library, so they run with any vLLM install that has the `extract_hidden_states` method (>= 0.18).
"""
