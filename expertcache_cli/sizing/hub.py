"""A model named by its Hugging Face id, found where vLLM would find it.

``vllm serve org/name`` downloads the checkpoint itself, so users type a Hub id, not a
path. `size`, `plan` and `serve` must size that same model before anything starts, and
they need only its ``config.json`` (a few KiB), never the weights. Where vLLM already
downloaded the model, its snapshot in the local Hugging Face cache is read instead, and
when the snapshot is complete its safetensors headers give the exact bytes.

The order, and the environment it honours, is the Hub client's: the local cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), then the Hub
(``HF_ENDPOINT``, a token from ``HF_TOKEN`` or the saved login), never the network with
``HF_HUB_OFFLINE=1``. Every way this can fail is one line that says what to do instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

#: ``org/name``: what the Hub accepts as a model id (no scheme, no path beyond one slash)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
TIMEOUT_S = 15.0
#: the revision vLLM will load (its ``--revision``, which the command line passes on):
#: set by `commands.passthrough_args`, read wherever a Hub id is sized
REVISION: ContextVar[str] = ContextVar("hub_revision", default="main")
#: how the running command is given a config.json instead of a Hub id, for the line that
#: says to: `size` and `plan` take it as the model, `serve` beside the id (`--size-from`)
GIVE_CONFIG: ContextVar[str] = ContextVar("hub_give_config", default="give its config.json")
#: the files beside config.json that vLLM reads a quantisation config from when
#: config.json declares none (ModelOpt checkpoints: `hf_quant_config.json`)
QUANT_SIDE_FILES = ("hf_quant_config.json",)


@dataclass(frozen=True)
class HubModel:
    """Where a Hub id's sizing comes from."""

    repo_id: str
    config: dict[str, Any]
    snapshot: Path | None  # a complete local snapshot (safetensors headers readable)
    origin: str  # said in the notes: the cache path or the URL


def is_hub_id(spec: str) -> bool:
    """``org/name`` that is not a path on this machine."""
    return (HUB_ID.fullmatch(spec) is not None and not spec.startswith(".")
            and not Path(spec).expanduser().exists())


def cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return _hf_home() / "hub"


def _hf_home() -> Path:
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def token() -> str | None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(name):
            return os.environ[name].strip()
    path = Path(os.environ["HF_TOKEN_PATH"]) if os.environ.get("HF_TOKEN_PATH") else (
        _hf_home() / "token")
    try:
        saved = path.read_text().strip()
    except OSError:
        return None
    return saved or None


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local cache's snapshot of ``repo_id`` at ``revision`` that holds a config.json."""
    revision = revision or REVISION.get()
    repo = cache_root() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snap = repo / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def complete(snapshot: Path) -> bool:
    """Every safetensors shard the snapshot's index names is there (an interrupted download
    leaves some out, and sizing from the rest would miss layers)."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return bool(shards) and all((snapshot / s).is_file() for s in shards)
    return (snapshot / "model.safetensors").is_file()


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{what}: {path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {path} does not hold a JSON object")
    return data


def _with_side_quant(config: dict[str, Any], side: dict[str, Any] | None) -> dict[str, Any]:
    """config.json plus the quantisation config vLLM would read beside it, if it has none."""
    if side and not (config.get("quantization_config") or config.get("compression_config")):
        quant = side.get("quantization") if isinstance(side.get("quantization"), dict) else {}
        return config | {"quantization_config": {"quant_method": "modelopt", **quant}}
    return config


def resolve(repo_id: str, revision: str | None = None, client: Any = None) -> HubModel:
    """``repo_id``'s config (and complete snapshot, if any) at ``revision`` (default: the
    one vLLM will load, `REVISION`): the local cache first, then the Hub. ``client`` is an
    ``httpx.Client`` (tests pass one with a mock transport)."""
    revision = revision or REVISION.get()
    snap = cached_snapshot(repo_id, revision)
    if snap is not None:
        config = _read_json(snap / "config.json", repo_id)
        side = next((_read_json(snap / f, repo_id) for f in QUANT_SIDE_FILES
                     if (snap / f).is_file()), None)
        return HubModel(repo_id, _with_side_quant(config, side),
                        snap if complete(snap) else None, f"the local Hugging Face cache ({snap})")
    if offline():
        raise UserError(f"{repo_id}: not in the local Hugging Face cache ({cache_root()}) and "
                        f"HF_HUB_OFFLINE is set: download it first, or {GIVE_CONFIG.get()}")
    config, url = _fetch(repo_id, "config.json", revision, client, required=True)
    side = None
    if not (config.get("quantization_config") or config.get("compression_config")):
        for name in QUANT_SIDE_FILES:
            side, _ = _fetch(repo_id, name, revision, client, required=False)
            if side is not None:
                break
    return HubModel(repo_id, _with_side_quant(config, side), None,
                    url if revision == "main" else f"{url} (--revision {revision})")


@functools.lru_cache(maxsize=16)
def _get_once(url: str, auth: tuple[tuple[str, str], ...]) -> Any:
    """One GET of a URL a process: `serve` sizes its model more than once (the plan, the
    check on online quantisation), and the Hub is asked once. A failure is not kept."""
    import httpx

    with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True) as client:
        return client.get(url, headers=dict(auth))


def _fetch(repo_id: str, name: str, revision: str, client: Any,
           required: bool) -> tuple[dict[str, Any] | None, str]:
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/{repo_id}/resolve/{revision}/{name}"
    auth = (("Authorization", f"Bearer {tok}"),) if (tok := token()) else ()
    try:
        resp = (client.get(url, headers=dict(auth)) if client is not None
                else _get_once(url, auth))
    except httpx.HTTPError as exc:
        raise UserError(f"{repo_id}: the Hugging Face Hub could not be reached for its "
                        f"{name} ({exc.__class__.__name__}: {exc}); offline, download the "
                        f"model first or {GIVE_CONFIG.get()}") from None
    if resp.status_code == 404 and not required:
        return None, url
    if resp.status_code in (401, 403):
        raise UserError(f"{repo_id}: the Hub refused its {name} ({resp.status_code}: a gated "
                        f"or private model): accept its terms and set HF_TOKEN, or "
                        f"{GIVE_CONFIG.get()}")
    if resp.status_code == 404:
        raise UserError(f"{repo_id}: no such model on the Hugging Face Hub ({url} answered "
                        "404): give a config.json, a model directory or a built-in model "
                        "(expertcache size --list)")
    if resp.status_code != 200:
        raise UserError(f"{repo_id}: the Hub answered {resp.status_code} for {url}; "
                        f"{GIVE_CONFIG.get()} instead")
    try:
        data = resp.json()
    except ValueError:
        raise UserError(f"{repo_id}: its {name} from {url} is not JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"{repo_id}: its {name} from {url} is not a JSON object")
    return data, url
