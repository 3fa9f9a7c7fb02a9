"""gateway.auth.owner_of: who owns a stored /v1/responses response (pure).

A keyed digest of the caller's API key (never the key itself, and not the rate-limit bucket's digest), one
shared owner while auth is off whatever key a caller sends.
"""

from __future__ import annotations

import pytest

from gateway.auth import OPEN_OWNER, owner_of, same_owner
from producer.admission import rate_key_for

KEYS = [b"key-a", b"key-b"]


def test_each_key_owns_apart_and_the_digest_never_holds_the_key() -> None:
    a, b = owner_of("key-a", KEYS), owner_of("key-b", KEYS)
    assert a != b and a == owner_of("key-a", KEYS)
    assert len(a) == 64 and int(a, 16) >= 0  # hex of HMAC-SHA256
    assert "key-a" not in a and a != OPEN_OWNER
    assert not a.startswith(rate_key_for("key-a"))  # another digest than the rate bucket's name
    assert same_owner(a, owner_of("key-a", KEYS)) and not same_owner(a, b) and not same_owner(a, OPEN_OWNER)


@pytest.mark.parametrize("sent", [None, "", "anything", "key-a"])
def test_with_auth_off_every_caller_is_one_owner(sent: str | None) -> None:
    assert owner_of(sent, []) == OPEN_OWNER
