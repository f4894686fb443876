"""Facts read from the installed vLLM, without importing it.

installed_vllm  the release and the text of its source files
capture         vLLM's CUDA-graph batch padding
vllm_flags      a user's `vllm serve` flags, read as vLLM reads them
vllm_runner     which model runner loads the model, and whether it offloads
vllm_experts    which experts kernel vLLM runs a quantised checkpoint on

Each fact names the releases it was read in; a new vLLM release is checked here first.
"""
