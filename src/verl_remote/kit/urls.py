"""A service's URL as a run's settings give it: checked once, before Ray, and never shown with a password.

A run prints and records its settings in several places (the console, ``verl-remote config``, verl's config
dump, the run's folder, each failed call's message), so a secret written into a URL (``http://user:pw@host``)
would travel with each of them. :func:`service_url` refuses such a URL, naming the setting that carries a token
instead, and refuses a scheme the backend cannot speak; :func:`token_in_clear` says when a token would cross the
network unencrypted.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
import warnings
from typing import Any

__all__ = ["checked_token", "read_token", "redacted", "service_url", "token_file_readable_by_others", "token_in_clear"]

#: Schemes a backend's HTTP client speaks.
SCHEMES = ("http", "https")


def redacted(url: str) -> str:
    """``url`` with whatever stands before ``@`` in its authority (a user, a password) replaced by ``***``."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def service_url(key: str, value: Any, *, token_setting: str) -> str:
    """``value``, the setting ``key``, as a service's URL without its trailing slash.

    ``ValueError`` naming ``key`` and the fix for: no value, a scheme other than http or https (``ftp://``), no
    host, a user or password in the URL (shown as ``***``: the refusal itself must not print it; the token
    belongs in ``token_setting``)."""
    text = str(value or "").strip()
    if not text:
        raise ValueError(f"{key} is not set: set {key}=http://HOST:PORT (or https://)")
    try:
        parts = urllib.parse.urlsplit(text)
        host = parts.hostname
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError as exc:
        raise ValueError(
            f"{key}={redacted(text)}: not a URL ({exc}); expected http://HOST:PORT or https://HOST"
        ) from None
    if "@" in parts.netloc:
        raise ValueError(
            f"{key}={redacted(text)}: a user or password in the URL would be printed and logged with every "
            f"message that names the service; take it out of the URL and give the token with {token_setting}"
        )
    if parts.scheme not in SCHEMES:
        if "://" not in text:
            raise ValueError(f"{key}={text}: not a URL; expected http://HOST:PORT or https://HOST")
        raise ValueError(f"{key}={text}: the scheme {parts.scheme}:// is not one the service is spoken to in; use "
                         "http:// or https://")  # fmt: skip
    if not host:
        raise ValueError(f"{key}={text}: no host in the URL; expected http://HOST:PORT or https://HOST")
    return text.rstrip("/")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_in_clear(url: str) -> bool:
    """Whether a token sent to ``url`` crosses a network unencrypted: plain http to a host that is not this
    machine's loopback."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme == "http" and not _loopback(parts.hostname or "")


def checked_token(token: str, where: str) -> str:
    """``token`` (its surrounding whitespace stripped) where it can go into an HTTP header as it is: one word of
    printable ASCII. ``ValueError`` starting with ``where`` (the setting and its value) otherwise, showing no part
    of the token: a token with a line break inside would be refused by the HTTP client in a message that quotes
    the whole header."""
    token = token.strip()
    if any(c.isspace() for c in token):
        raise ValueError(
            f"{where}: the token has a line break or a space inside it (not shown); a token is one word: write it "
            "alone, on one line"
        )
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(
            f"{where}: the token has a character that is not printable ASCII inside it (not shown), which no HTTP "
            "header carries; copy the token again from where it was issued"
        )
    return token


def token_file_readable_by_others(path: str) -> bool:
    """Whether the file ``path`` may be read by users other than its owner (its mode gives the group or others
    read access)."""
    try:
        return bool(os.stat(path).st_mode & 0o044)
    except OSError:
        return False


def read_token(env_key: str, env_name: Any, file_key: str, file_path: Any) -> str | None:
    """The token a run's settings point at: the environment variable ``env_name`` (the setting ``env_key``) or
    the file ``file_path`` (the setting ``file_key``, its content stripped), or None where neither is set.
    ``ValueError`` naming the setting for: both set, an empty variable, a file missing, unreadable or empty, a
    token with whitespace or a character that is not printable ASCII inside it (:func:`checked_token`). A file
    that others may read gets a ``UserWarning`` (the preflight shows it before the run). The token itself is never
    in a message."""
    if env_name and file_path:
        raise ValueError(f"{env_key}={env_name} and {file_key}={file_path}: set one of them, not both")
    if env_name:
        token = os.environ.get(str(env_name), "").strip()
        if not token:
            raise ValueError(f"{env_key}={env_name}: that environment variable is empty; export {env_name}=<token> "
                             "before the run")  # fmt: skip
        return checked_token(token, f"{env_key}={env_name}")
    if file_path:
        path = os.path.expanduser(str(file_path))
        try:
            with open(path, encoding="utf-8") as file:
                token = file.read().strip()
        except OSError as exc:
            raise ValueError(f"{file_key}={file_path}: cannot read it ({exc.strerror}); write the token into that "
                             "file, readable by the user who runs the job (chmod 600)") from None  # fmt: skip
        except UnicodeDecodeError:
            raise ValueError(f"{file_key}={file_path}: the file is not text (UTF-8); write the token into it as "
                             "text") from None  # fmt: skip
        if not token:
            raise ValueError(f"{file_key}={file_path}: the file is empty; write the token into it")
        token = checked_token(token, f"{file_key}={file_path}")
        if token_file_readable_by_others(path):
            warnings.warn(
                f"{file_key}={file_path}: other users of this machine may read the token in it; chmod 600 {path}",
                UserWarning,
                stacklevel=2,
            )
        return token
    return None
