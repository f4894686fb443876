"""Sizing: a model on a card, with no GPU and no torch.

model_size  a preset, config.json or model directory as sizing sees it
formats     the tensors one expert becomes in vLLM, per weight format
presets     the built-in model presets
cards       cards by name: their real memory and usual host link
sizing      slots, verdict, vLLM flags and the sizing trap (`expertcache size`)
"""
