"""Cards by name: the memory a GPU really reports, and the host link it usually sits on.

Why: cards sold as "24 GB" are not one size. An L4 or an A10G reports 22.49 GiB to the
driver, an RTX 4090 23.99, an RTX 3090 24.00; a plan for "24" on an L4 promises 1.5 GiB
that is not there. ``--vram`` therefore takes a card's name as well as a number of GiB,
and the name carries what ``nvidia-smi --query-gpu=memory.total`` prints for that card
(MiB), which is what vLLM's share of it is computed from. The link generation is the
PCIe slot the card is built for; `plan` uses it when no link was measured
(`typical_link_gbps`), and says so.

A plain number stays GiB, as it always was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

MiB = 1024**2
GiB = 1024**3

#: What the cache's gather reaches of a PCIe link's per-direction rate: 51.3 GB/s of a
#: Gen5 x16 link's 63.0, measured (source in docs/design.md, measured constants). `plan`
#: scales the other generations by the same fraction when nothing was probed: an
#: estimate, and it says so.
GATHER_FRACTION_OF_LINK = 51.3 / 63.0

#: GB/s one way for an x16 link of each PCIe generation (after line coding)
_PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}


@dataclass(frozen=True)
class Card:
    """A GPU as `size`, `serve` and `plan` plan for it."""

    name: str
    label: str
    memory_mib: int  # nvidia-smi's memory.total
    pcie_gen: int
    pcie_lanes: int = 16

    @property
    def gib(self) -> float:
        return self.memory_mib * MiB / GiB

    @property
    def link(self) -> str:
        return f"PCIe {self.pcie_gen}.0 x{self.pcie_lanes}"

    def describe(self) -> str:
        """'RTX 4090 (23.99 GiB, PCIe 4.0 x16)': what a plan says it planned for."""
        return f"{self.label} ({self.gib:.2f} GiB, {self.link})"


_CARDS = (
    Card("rtx-3060", "RTX 3060 12 GB", 12288, 4),
    Card("rtx-3080", "RTX 3080 10 GB", 10240, 4),
    Card("rtx-3090", "RTX 3090", 24576, 4),
    Card("rtx-3090-ti", "RTX 3090 Ti", 24564, 4),
    Card("rtx-4060-ti", "RTX 4060 Ti 16 GB", 16380, 4, 8),
    Card("rtx-4070-ti-super", "RTX 4070 Ti SUPER", 16376, 4),
    Card("rtx-4080", "RTX 4080", 16376, 4),
    Card("rtx-4090", "RTX 4090", 24564, 4),
    Card("rtx-5080", "RTX 5080", 16303, 5),
    Card("rtx-5090", "RTX 5090", 32607, 5),
    Card("a10g", "A10G", 23028, 4),
    Card("a10", "A10", 23028, 4),
    Card("l4", "L4", 23034, 4),
    Card("a6000", "RTX A6000", 49140, 4),
    Card("rtx-6000-ada", "RTX 6000 Ada", 49140, 4),
    Card("l40s", "L40S", 46068, 4),
    Card("a100-40", "A100 40 GB", 40960, 4),
    Card("a100-80", "A100 80 GB", 81920, 4),
    Card("h100", "H100 80 GB (PCIe)", 81559, 5),
    Card("h200", "H200 NVL", 143771, 5),
)

CARDS: dict[str, Card] = {c.name: c for c in _CARDS}


def _key(text: str) -> str:
    return text.strip().lower().replace("_", "-").replace(" ", "-")


def parse_vram(text: str | float | None) -> tuple[float | None, Card | None]:
    """``--vram``: a number of GiB, or a card's name -> (GiB, the card or None).

    One line names the known cards when neither reads; a number must be finite and
    positive.
    """
    if text is None:
        return None, None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        card = CARDS.get(_key(str(text)))
        if card is not None:
            return card.gib, card
        try:
            value = float(str(text).strip().lower().removesuffix("gib").removesuffix("gb"))
        except ValueError:
            raise UserError(
                f"--vram {text!r}: neither GiB nor a known card; cards: {', '.join(CARDS)}"
            ) from None
    if not math.isfinite(value):
        raise UserError(f"--vram must be a finite number of GiB or a card name, got {text}")
    if value <= 0:
        raise UserError(f"--vram must be positive, got {value:g}")
    return value, None


def vram_label(gib: float, card: Card | None) -> str:
    """How a plan names what it planned for: the card and its memory, or the GiB given."""
    return card.describe() if card is not None else f"{gib:g} GiB"


def typical_link_gbps(card: Card) -> float:
    """The gather rate a card's usual slot gives, scaled from the measured fraction of a
    Gen5 x16 link (`GATHER_FRACTION_OF_LINK`): an estimate for planning without a probe."""
    per_lane = _PCIE_X16_GBPS[card.pcie_gen] / 16
    return round(per_lane * card.pcie_lanes * GATHER_FRACTION_OF_LINK, 1)
