"""Planning: from a trace, a card and a link to a decision and the command that serves it.

planner  predicted decode speed per policy and budget, and the plan file (`expertcache plan`)
inputs   what `plan` rests on, chosen from what the user gave: which source of each rate wins
serving  the server a plan or a re-batched replay is for (batch flags, vLLM release)
rebatch  what n users would cost: a single-stream trace re-batched
launch   the sized `vllm serve` command with the cache (`expertcache serve`)
"""
