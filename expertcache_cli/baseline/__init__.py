"""`expertcache baseline`: the library behind the command.

arms     what a server configuration means (env, vLLM flags) and the rotated order
server   command templates, process-group lifecycle, health wait, log tails
groups   records of the servers' process groups, for ending what a killed run left
client   the streaming OpenAI client that times tokens
store    the JSONL results file (append + fsync, resume)
counters the plugin's stats lines in a server log
summary  pandas statistics, warnings and the rich table
plot     the optional figure
runner   the protocol that ties them together

Nothing here imports torch or vllm: the baseline talks to servers as a user does.
"""
