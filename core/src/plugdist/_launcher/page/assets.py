"""The live page itself: ``page.html`` beside this module, one HTML document with its style and
script inline (no framework, no file fetched from elsewhere: a cluster often has no internet).
The script polls ``api/state`` once a second and redraws; once the launcher no longer answers,
it keeps the last state it saw and says so."""

from __future__ import annotations

from pathlib import Path

__all__ = ["page_html"]

_PAGE = Path(__file__).with_name("page.html")


def page_html() -> bytes:
    """The page, as served (read once per request: small, and edits show without a restart)."""
    return _PAGE.read_bytes()
