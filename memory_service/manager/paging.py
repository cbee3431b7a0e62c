"""Pages of ListSequences: the page size's bounds and the opaque page token (Google AIP-158).

A page token is the base64url (no padding) of ``seq:<id>``, the first sequence id of
the next page; sequence ids are never reused, so a token stays valid while sequences
come and go (a page shows the live sequences at the time it is read).
"""

from __future__ import annotations

import base64
import binascii

from pagedkv.runtime.errors import InvalidArgumentError

#: Sequences in a page when the request leaves page_size at 0.
DEFAULT_PAGE_SIZE = 1000
#: Most sequences one page may hold: a page is built on the event loop, and 10,000 took ~90 ms on a
#: quiet 2-core VM (benchmarks/bench_memory_latency.py), over the ~50 ms any call may hold it.
MAX_PAGE_SIZE = 2_000
#: Longest page token this service issues, characters.
_MAX_TOKEN_CHARS = 40
_PREFIX = "seq:"


def page_size(requested: int) -> int:
    """The page size for a request's ``page_size`` (0 = :data:`DEFAULT_PAGE_SIZE`).

    Raises:
        InvalidArgumentError: more than :data:`MAX_PAGE_SIZE`.
    """
    if requested > MAX_PAGE_SIZE:
        raise InvalidArgumentError(f"page_size {requested} is more than the limit of {MAX_PAGE_SIZE} sequences a page; "
                                   "ask for fewer and follow next_page_token")
    return requested or DEFAULT_PAGE_SIZE


def encode_page_token(next_id: int | None) -> str:
    """The token of the page that starts at sequence ``next_id``; "" when there is no next page."""
    if next_id is None:
        return ""
    return base64.urlsafe_b64encode(f"{_PREFIX}{next_id}".encode()).decode().rstrip("=")


def decode_page_token(token: str) -> int:
    """The first sequence id of the page ``token`` names (0 for "", the first page).

    Raises:
        InvalidArgumentError: a token this service did not issue.
    """
    if not token:
        return 0
    bad = InvalidArgumentError(f"page_token {token[:_MAX_TOKEN_CHARS]!r} is not one this service issued; pass the "
                               "next_page_token of the previous page unchanged, or leave it empty for the first page")
    if len(token) > _MAX_TOKEN_CHARS:
        raise bad
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        raise bad from None
    digits = text[len(_PREFIX):]
    if not text.startswith(_PREFIX) or not digits.isascii() or not digits.isdigit():
        raise bad
    next_id = int(digits)
    if encode_page_token(next_id) != token:  # only the exact spelling this service issues
        raise bad
    return next_id
