"""A TLS file option of the Redis tier that names no file is refused when the config is
read, naming the option and the path. Before, it was accepted, and the tier then failed
at run time as "unavailable (ConnectionError: Error 2 connecting to 127.0.0.1:6380. No
such file or directory.)": a server problem to read, naming neither (a docs-only probe)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.backends.remote_options import parse_options

from kvtier.errors import ConfigError

URL = "rediss://127.0.0.1:6380/0"


@pytest.mark.parametrize(
    ("option", "what"),
    [
        ("tls_ca_certs", "the CA bundle"),
        ("tls_certfile", "the client certificate"),
        ("tls_keyfile", "the client key"),
    ],
)
def test_a_tls_file_that_is_not_there_is_named(tmp_path: Path, option: str, what: str) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"'{option}' \\({what}\\): '{missing}' does not exist"):
        parse_options({"url": URL, option: str(missing)})
    with pytest.raises(ConfigError, match="is a directory"):
        parse_options({"url": URL, option: str(tmp_path)})
    there = tmp_path / "there.pem"
    there.write_text("-----BEGIN CERTIFICATE-----\n")
    assert getattr(parse_options({"url": URL, option: str(there)}), option) == str(there)
