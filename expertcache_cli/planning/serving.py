"""The server a plan or a re-batched replay is for: its batch flags and vLLM release.

`plan --batch N` and `replay --batch N` price N streams as the server will run them: a
decode step of N sequences is padded to the smallest CUDA-graph capture size >= N, and
the capture sizes depend on ``--max-num-seqs``, the batched tokens, the graph flags and
the vLLM release (`capture`: vLLM 0.26-0.30 pad a full batch of 10 to 16, 0.31+ capture
10 itself). The flags are read as `size` and `serve` read them (`vllm_flags`); an option
given to the command itself (``--max-num-seqs``) wins over the same flag after ``--``.

The server's ``--max-num-seqs`` is the user's where given, else the batch itself (N
users: a server of N sequences, which `plan`'s serve command then carries), else vLLM's
default for the card. The release is ``--vllm-version``, else the installed one, else the
newest whose rule was read; where it is assumed, the batches that must stay on the cache
(`safe_max_num_seqs`, `widest_ids`) are counted under the oldest rule too, the one that
pads most, so a printed ``--max-num-seqs`` holds on every release the plugin supports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserError
from ..vllm_facts import capture
from ..vllm_facts.vllm_flags import plan_kwargs_from_vllm_args, with_flag

if TYPE_CHECKING:
    from ..sizing.model_size import ModelSize


@dataclass(frozen=True)
class Server:
    """What decides how a decode batch is padded, and where each part came from."""

    vllm_args: list[str]  # the user's vLLM flags (the --max-num-seqs option applied)
    max_num_seqs: int
    seqs_source: str
    seqs_given: bool  # the user chose it (option or flag): a plan keeps it
    max_num_batched_tokens: int
    release: capture.Release
    graphs: capture.GraphSettings  # under `release`
    oldest: capture.GraphSettings  # the same flags under the oldest known release

    @property
    def safety_graphs(self) -> list[capture.GraphSettings]:
        """The graph settings a printed batch must be safe under: the known release's, or
        where it is assumed, the oldest rule's as well (it pads most)."""
        return [self.graphs] if self.release.known else [self.oldest, self.graphs]

    def batch_tokens(self, batch: int) -> int:
        """Tokens a step of ``batch`` sequences runs at, under the release assumed."""
        return capture.batch_tokens(batch, self.max_num_seqs, self.max_num_batched_tokens,
                                    self.graphs)

    def widest_ids(self, top_k: int, max_num_seqs: int | None = None) -> int:
        """Routing ids of a full decode batch (padded) on a server of ``max_num_seqs``
        (default: this one's), the most any release in `safety_graphs` pads it to."""
        seqs = self.max_num_seqs if max_num_seqs is None else max_num_seqs
        return top_k * max(capture.padded_batch(seqs, self.max_num_batched_tokens, g)
                           for g in self.safety_graphs)

    def safe_max_num_seqs(self, slots: int, top_k: int) -> int:
        """The largest ``--max-num-seqs`` whose full batch fits ``slots`` on every release
        in `safety_graphs`."""
        return min(capture.safe_max_num_seqs(slots, top_k, self.max_num_batched_tokens, g)
                   for g in self.safety_graphs)

    def describe_batch(self, batch: int) -> str:
        """One line: what a batch of ``batch`` runs as, and what that rests on."""
        tokens = self.batch_tokens(batch)
        runs = (f"{tokens} tokens a step (padded to a CUDA graph)" if tokens != batch
                else f"{tokens} tokens a step (unpadded)")
        graphs = ("" if self.graphs.source.startswith("vLLM's defaults")
                  else f", CUDA graphs: {self.graphs.source}")
        return (f"a batch of {batch} runs as {runs}: --max-num-seqs {self.max_num_seqs} "
                f"({self.seqs_source}), {self.max_num_batched_tokens} batched tokens, vLLM "
                f"{self.release.name} ({self.release.source}){graphs}")

    def to_json(self, batch: int | None) -> dict:
        return {"max_num_seqs": self.max_num_seqs, "max_num_seqs_source": self.seqs_source,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "vllm": self.release.name, "vllm_source": self.release.source,
                "graphs": self.graphs.source,
                "batch_tokens": self.batch_tokens(batch) if batch else None}


def server(vllm_args: Sequence[str], *, max_num_seqs: int | None = None,
           batch: int | None = None, vllm_version: str | None = None,
           vram_gib: float | None = None,
           installed: tuple[int, int] | None | bool = True,
           architectures: Sequence[str] = ()) -> Server:
    """The server ``vllm_args`` (and the command's own options) describe.

    ``max_num_seqs``: the command's ``--max-num-seqs`` (wins over the flag); ``batch``:
    the streams to price, which the server must be able to run at once; ``vram_gib``:
    the card, whose size decides vLLM's batch defaults (None: under 70 GiB);
    ``architectures``: the model's, whose vLLM config may move the capture ceiling
    (`capture.for_model`).
    """
    from ..sizing.sizing import vllm_defaults

    args = list(vllm_args)
    if max_num_seqs is not None:
        if max_num_seqs < 1:
            raise UserError(f"--max-num-seqs must be positive, got {max_num_seqs}")
        args = with_flag(args, "--max-num-seqs", str(max_num_seqs))
    kw = plan_kwargs_from_vllm_args(args)
    given = kw.get("max_num_seqs")
    if given is not None and given < 1:
        raise UserError(f"--max-num-seqs must be positive, got {given}")
    d_seqs, d_batched = vllm_defaults(vram_gib or 0)
    if batch is not None and given is not None and batch > given:
        raise UserError(f"--batch {batch} is more than --max-num-seqs {given}: that server "
                        f"runs at most {given} sequences at once")
    if given is not None:
        seqs, source = given, "given"
    elif batch is not None:
        seqs, source = batch, "the batch: a server for that many users"
    else:
        seqs, source = d_seqs, "vLLM's default" + (" for the card" if vram_gib else "")
    batched = kw.get("max_num_batched_tokens") or d_batched
    release = capture.serving_release(vllm_version, installed)
    return Server(
        vllm_args=args, max_num_seqs=int(seqs), seqs_source=source,
        seqs_given=given is not None, max_num_batched_tokens=int(batched), release=release,
        graphs=capture.for_model(
            capture.settings_from_vllm_args(args, version=release.version), architectures),
        oldest=capture.for_model(
            capture.settings_from_vllm_args(args, version=capture.OLDEST_KNOWN),
            architectures),
    )


def architectures_of(model: ModelSize | None, trace_model: str | None) -> tuple[str, ...]:
    """The served model's architectures, which may move vLLM's capture ceiling: the
    ``--model`` given, else the preset the first word of the trace's recorded model name
    matches (a trace of gpt-oss is served as gpt-oss), else none known (vLLM's
    defaults)."""
    if model is not None:
        return model.architectures
    if trace_model and trace_model.split():
        from ..sizing.model_size import config_architectures
        from ..sizing.presets import find_preset

        preset = find_preset(trace_model.split()[0])
        if preset is not None:
            return config_architectures(preset.config)
    return ()
