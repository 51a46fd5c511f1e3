"""minitp.viz.format: the one byte formatter every table and figure uses (decimal units)."""

from minitp.viz.format import byte_scale, format_bytes


def test_format_bytes_uses_decimal_units():
    assert format_bytes(230_144) == "230.1 KB"
    assert format_bytes(1_500_000) == "1.5 MB"
    assert format_bytes(2e9) == "2.0 GB"
    assert format_bytes(999) == "999 B"


def test_byte_scale_picks_the_largest_unit_the_value_reaches():
    assert byte_scale(999) == ("bytes", 1.0)
    assert byte_scale(1000) == ("KB", 1e3)
    assert byte_scale(3.2e7) == ("MB", 1e6)
