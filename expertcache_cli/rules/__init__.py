"""The cache rules and the replay: what a slot cache does, counted on any machine.

policy        the reference cache (the one place the rules are written in code)
engine        the same rules compiled with numba, for whole traces at sweep speed
budget        the slot budget's rules (fractions, the slot limit, the online policies)
trace         routing trace files: load, validate, save
trace_import  other engines' routing recordings converted to trace files
replay        a trace under policies and budgets (`expertcache replay`)
split         a total budget split across layers
synth         synthetic traces

Nothing here imports torch or vLLM, and nothing here reads the environment.
"""
