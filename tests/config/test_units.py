import pytest

from mpress.errors import UserError
from mpress.config.units import fmt_bytes, fmt_seconds, parse_bytes


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


@pytest.mark.parametrize("huge", ["1e400", "2e18GiB", "1e19", "1.0e+400"])
def test_parse_bytes_refuses_sizes_beyond_the_bound_in_one_line(huge):
    # 1e400 used to end in OverflowError (int(inf)) with a traceback
    with pytest.raises(UserError) as info:
        parse_bytes(huge, "--device-memory")
    assert "--device-memory" in str(info.value) and "at most" in str(info.value)


def test_parse_bytes_accepts_the_bound_and_an_explicit_plus_exponent():
    from mpress.config.units import MAX_BYTES
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    assert parse_bytes("1e+9") == 10**9
