"""The device binding: the kernels, their build and ABI, and the objects that drive them.

kernel_build   the kernel source compiled by NVRTC (cached per user) or built by nvcc
binding        the kernel ABI: argument order, C types, checks, launches
slotcache      one MoE layer's slot cache on the device
scratch        the VRAM scratch that stages a wide step
audit          a layer's cache checked at rest
device_replay  a trace replayed through the real manager kernel
kernel_check   is there a GPU, and do the kernels run right on it
gpu_info       the GPU's memory as vLLM will see it (nvidia-smi)

The binding reads no environment: where the kernels come from (a library or NVRTC) and
whether they launch with PDL is its caller's choice (`binding.select`).
"""
