"""expertcache: a VRAM cache of MoE expert slots for vLLM, and the tools to size it.

Importing the package is cheap on purpose: torch and vllm are imported only by the
modules that drive a GPU, so `replay`, `size` and `trace` start fast on any machine.
"""

__version__ = "0.1.0"
