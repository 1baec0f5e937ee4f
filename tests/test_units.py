import pytest

from mpress.errors import UserError
from mpress.units import fmt_bytes, fmt_seconds, parse_bytes


def test_parse_bytes():
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("1.5 kb") == 1500


@pytest.mark.parametrize("bad", ["", "two", "5 parsecs", "0", "-1GB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(UserError):
        parse_bytes(bad, "--device-memory")


def test_format():
    assert fmt_bytes(32e9) == "32 GB"
    assert fmt_bytes(999) == "999 B"
    assert fmt_seconds(0.0123) == "12.3 ms"
    assert fmt_seconds(2.5) == "2.5 s"
