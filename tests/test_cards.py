"""`--vram` by card name: the memory each card reports, the link it sits on."""

import pytest

from expertcache_cli.errors import UserError
from expertcache_cli.sizing import cards


def test_a_number_stays_gib_and_a_name_is_the_card():
    assert cards.parse_vram("24") == (24.0, None)
    assert cards.parse_vram(16.5) == (16.5, None)
    gib, card = cards.parse_vram("RTX-4090")
    assert card is cards.CARDS["rtx-4090"] and gib == pytest.approx(24564 / 1024)
    assert cards.parse_vram("rtx_3090")[1] is cards.CARDS["rtx-3090"]
    assert cards.parse_vram(None) == (None, None)


@pytest.mark.parametrize("name, gib", [("l4", 22.49), ("a10g", 22.49), ("rtx-4090", 23.99),
                                       ("rtx-3090", 24.00), ("rtx-5090", 31.84),
                                       ("rtx-4080", 15.99), ("a6000", 47.99),
                                       ("l40s", 44.99)])
def test_cards_sold_as_one_size_report_different_memory(name, gib):
    assert cards.CARDS[name].gib == pytest.approx(gib, abs=0.005)


@pytest.mark.parametrize("text, words", [("rtx-9999", "neither GiB nor a known card"),
                                         ("nan", "finite"), ("-3", "positive"),
                                         ("0", "positive")])
def test_bad_vram_is_one_line(text, words):
    with pytest.raises(UserError, match=words):
        cards.parse_vram(text)


def test_typical_link_scales_the_measured_gather_fraction():
    gen5, gen4 = cards.CARDS["rtx-5090"], cards.CARDS["rtx-4090"]
    assert cards.typical_link_gbps(gen5) == pytest.approx(51.3, abs=0.1)  # the H200's own
    assert cards.typical_link_gbps(gen4) == pytest.approx(51.3 / 2, abs=0.1)
    x8 = cards.CARDS["rtx-4060-ti"]
    assert cards.typical_link_gbps(x8) == pytest.approx(51.3 / 4, abs=0.1)
