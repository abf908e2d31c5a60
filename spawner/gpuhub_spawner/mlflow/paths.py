"""One reading of a request path, shared by the proxy's rules and MLflow's routing.

MLflow's server (uvicorn, then Flask/werkzeug through WSGI) routes and authorizes
on the *percent-decoded* path: ``/api/2.0/mlflow/%65xperiments/create`` is
``experiments/create`` to MLflow. A proxy rule written against the raw path is
therefore bypassed by encoding one letter. So the proxy decodes the path once,
exactly as uvicorn does (``urllib.parse.unquote``), refuses every path whose
meaning could differ between readers, and then forwards a canonical re-encoding
of the decoded path, which MLflow decodes back to the very string the rules saw.

Refused as ambiguous (HTTP 400): an encoded ``/`` or ``\\`` (``%2F``, ``%5C``),
a backslash, a ``.`` or ``..`` segment (however encoded, e.g. ``%2e%2E``), an
empty segment (``//``), control characters, bytes that are not UTF-8, and a path
that still holds percent-escapes after decoding (double encoding, ``%2565``).
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_ENCODED_SEPARATOR = re.compile(r"%(?:2[Ff]|5[Cc])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Kept literal when re-encoding: RFC 3986 pchar minus '%', plus '/'.
_SAFE = "/:@!$&'()*+,;=-._~"


class AmbiguousPath(ValueError):
    """A request path that readers could disagree about; answered with 400."""


def decode_path(raw: str) -> str:
    """The decoded form of ``raw`` (a request path without query), or AmbiguousPath."""
    if _ENCODED_SEPARATOR.search(raw):
        raise AmbiguousPath("encoded '/' or '\\' in the path")
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise AmbiguousPath("percent-escapes that are not UTF-8") from None
    if "\\" in decoded:
        raise AmbiguousPath("backslash in the path")
    if _CONTROL.search(decoded):
        raise AmbiguousPath("control character in the path")
    if _ESCAPE.search(decoded):
        raise AmbiguousPath("percent-escape left after decoding (double encoding)")
    if not decoded.startswith("/"):
        raise AmbiguousPath("path does not start with '/'")
    segments = decoded.split("/")[1:]
    for i, segment in enumerate(segments):
        if segment in (".", ".."):
            raise AmbiguousPath(f"'{segment}' segment in the path")
        if segment == "" and i != len(segments) - 1:
            raise AmbiguousPath("empty segment ('//') in the path")
    return decoded


def encode_path(decoded: str) -> str:
    """The canonical percent-encoding of a decoded path (``unquote`` gives it back)."""
    return quote(decoded, safe=_SAFE)
