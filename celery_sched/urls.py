"""Masking the secrets of connection URLs, so that they can be logged.

Its own module because both :mod:`celery_sched.settings` and
:mod:`celery_sched.redisconn` (which settings uses to check the Redis URL)
name URLs in their errors.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["sanitize_url"]

#: A ``key=value`` parameter of a URL query or a libpq conninfo string.
_PARAMETER = re.compile(r"(?P<key>[^\s?&;=#]+)=(?P<value>[^\s&;#]*)")

#: Where one URL of a list ends and the next begins: Kombu's failover lists
#: (``sentinel://a:26379;sentinel://b:26379``) join whole URLs with ``;``.
#: A ``;`` between query parameters (``?heartbeat=5;x=1``) starts no scheme.
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")

#: Parameter names (case-insensitive substrings) whose values are secrets:
#: libpq's ``password`` and ``sslpassword``, redis-py's ``password``, and the
#: like of other drivers.
_SECRET_NAMES = ("password", "passwd", "pwd", "passphrase", "secret", "token")


def _mask_parameter(match: re.Match[str]) -> str:
    key = urllib.parse.unquote_plus(match["key"]).lower()
    if any(name in key for name in _SECRET_NAMES):
        return f"{match['key']}=***"
    return match.group()


def _mask_userinfo(url: str) -> str | None:
    """``url`` with the password of its user part masked; ``None`` when
    ``url`` cannot be split."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return None
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def sanitize_url(url: str) -> str:
    """``url`` with every password replaced by ``***``; safe to log.

    Masks the password of the user part and the value of every
    password-like parameter (``?password=``, ``sslpassword=``,
    ``sentinel_password=``, ...), in the query and wherever else
    ``key=value`` appears. A Kombu-style list of URLs joined by ``;`` has
    the user part of each URL masked.
    """
    masked = [_mask_userinfo(part) for part in _NEXT_URL.split(url)]
    if any(part is None for part in masked):
        return "<unparsable url>"
    url = ";".join(part for part in masked if part is not None)
    if "=" not in url:
        return url
    return _PARAMETER.sub(_mask_parameter, url)
