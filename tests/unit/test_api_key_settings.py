"""api.api_keys must be what an HTTP header carries unchanged: printable ASCII, no space at either end.

Reported: a key with a non-ASCII character (``"clé-1"``) was accepted at start and never matched. The
gateway reads a header as latin-1 (the bytes of ``é`` in UTF-8 become two characters) and compares it with the
setting encoded as UTF-8; the OpenAI SDK (httpx) cannot send such a header at all. Now the settings refuse it,
naming ``api.api_keys``, never showing the key.
"""

from __future__ import annotations

import pytest

from gateway.auth import key_refusal
from protocol.errors import ConfigError
from protocol.settings import load_settings


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        (["ok-key", "clé-1"], "key 1 holds a non-ASCII character at character 2"),
        (["tab\tkey"], "key 0 holds a control character at character 3"),
        (["line\nkey"], "key 0 holds a control character"),
        (["del\x7fkey"], "key 0 holds a control character"),
        ([" padded"], "key 0 starts or ends with a space"),
        (["padded "], "key 0 starts or ends with a space"),
        ([""], "key 0 is empty"),
    ],
)
def test_a_key_no_header_carries_is_refused_at_load(keys: list[str], said: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, api={"api_keys": keys})
    assert info.value.field == "api.api_keys"
    assert said in info.value.message, info.value.message
    for key in keys:
        if key.strip():
            assert key not in info.value.message  # a secret is never shown


def test_printable_ascii_keys_load_and_match_as_sent() -> None:
    keys = ["k-1", "with inner space", "~!@#$%^&*()_+{}|:<>?"]
    settings = load_settings(None, api={"api_keys": keys})
    encoded = [k.encode() for k in settings.api.api_keys]
    for key in keys:  # as the gateway reads a header: its bytes decoded as latin-1
        assert key_refusal(key.encode("ascii").decode("latin-1"), encoded) is None

