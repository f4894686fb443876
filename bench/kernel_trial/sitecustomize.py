"""BENCH ONLY: with EC_BENCH_TRY_KERNELS set (comma-separated experts-kernel class names,
e.g. ``MarlinExperts``) and this folder on PYTHONPATH, the plugin in every process of the
benchmark treats those kernels as known to index weights by expert id, so a device run
can try arming a kernel before it is added to `plugin.compat.KNOWN_EXPERTS`. The layer's
first eager call is still checked against the stock path (plugin.runtime), and every other
arming rule still applies. Without the variable it does nothing. It shadows any other
sitecustomize on the path: bench use only, never in a user's environment."""

import os

_names = {n.strip() for n in os.environ.get("EC_BENCH_TRY_KERNELS", "").split(",") if n.strip()}
if _names:
    from expertcache_cli.plugin import arming, compat

    compat.KNOWN_EXPERTS = compat.KNOWN_EXPERTS | _names
    arming.KNOWN_EXPERTS = compat.KNOWN_EXPERTS
