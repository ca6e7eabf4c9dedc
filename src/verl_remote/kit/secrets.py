"""What looks like a secret, and the environment a launched service gets without the user's credentials.

A run prints its config (the console, ``verl-remote config``, verl's dump in the log) and records it in its folder,
and a service a backend launches inherits whatever environment it is given. :func:`looks_secret` is the one rule
for both: a name that says token, secret, password, credential or API key is a secret's name, except where it names
where the secret is (``token_env``, ``api_key_file``). :func:`service_environment` is this process's environment
less every variable whose name looks secret, except those the user names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from verl_remote.kit.urls import redacted

__all__ = ["REDACTED", "looks_secret", "redact", "secret_keys", "service_environment"]

#: What stands for a secret's value wherever a config is shown or recorded.
REDACTED = "***"

#: A word that makes a name a secret's, alone or inside a word (PGPASSWORD, MYSECRET).
_SECRET_WORDS = ("PASSWORD", "PASSWD", "PASSPHRASE", "SECRET", "CREDENTIAL", "APIKEY")
#: A last word that makes a name a secret's: ``HF_TOKEN``, ``access_token`` (verl's ``max_token_len_per_gpu`` and
#: ``TOKENIZERS_PARALLELISM`` are not: TOKEN is not their last word).
_SECRET_NAMES = {"TOKEN", "PAT", "AUTHTOKEN", "BEARER", "COOKIE"}
#: The words before a final KEY that make it a secret's (``api_key``, ``ACCESS_KEY``); a config's ``prompt_key``
#: names a data column, but an environment variable's KEY (upper case, ``SIGNING_KEY``) is taken as a secret.
_KEY_KINDS = {"API", "ACCESS", "PRIVATE", "SECRET", "AUTH", "SIGNING", "ENCRYPTION", "MASTER", "LICENSE", "SSH"}
#: A last word that says where a secret is kept, not the secret: ``token_env``, ``api_key_file``.
_POINTERS = {"ENV", "FILE", "PATH", "DIR", "VAR", "NAME"}


def looks_secret(name: str) -> bool:
    """Whether a setting or an environment variable called ``name`` holds a secret by its name.

    >>> [looks_secret(n) for n in ("HF_TOKEN", "WANDB_API_KEY", "db_password", "token_env", "prompt_key")]
    [True, True, True, False, False]
    """
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name.upper()) if w]
    if not words or words[-1] in _POINTERS:
        return False
    if any(secret in word for word in words for secret in _SECRET_WORDS):
        return True
    if words[-1] in _SECRET_NAMES:
        return True
    if words[-1] == "KEY":
        return name.isupper() or (len(words) > 1 and words[-2] in _KEY_KINDS)
    return False


def redact(node: Any, secret: bool = False) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars, as ``OmegaConf.to_container`` gives) fit to show or
    record: the value of every key that :func:`looks_secret`, and all below it, is :data:`REDACTED` (an
    interpolation not yet resolved, ``${oc.env:PW}``, says where the secret is and stays); a URL's user and password
    are ``***``. ``secret``: ``node`` is a secret's value."""
    if isinstance(node, Mapping):
        return {key: redact(value, secret or looks_secret(str(key))) for key, value in node.items()}
    if isinstance(node, list):
        return [redact(value, secret) for value in node]
    if isinstance(node, str):
        if secret and not node.startswith("${"):
            return REDACTED
        return redacted(node) if "://" in node and "@" in node else node
    if secret and isinstance(node, (int, float)) and not isinstance(node, bool):
        return REDACTED
    return node


def secret_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a plain config tree whose values :func:`redact` hides (set, and not an interpolation)."""
    if isinstance(node, Mapping):
        found = []
        for key, value in node.items():
            path = f"{prefix}{key}"
            if looks_secret(str(key)) and redact(value, secret=True) != value:
                found.append(path)
            else:
                found += secret_keys(value, path + ".")
        return found
    if isinstance(node, list):
        return [key for index, value in enumerate(node) for key in secret_keys(value, f"{prefix}{index}.")]
    return []


def service_environment(keep: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a service this process launches: this process's (or ``environ``), less every variable
    whose name :func:`looks_secret`, except the names in ``keep`` (the credentials the service itself needs).

    A launched service is a program of its own: it gets what it needs to run (``PATH``, ``HOME``, the Python and
    CUDA settings), not every credential of the user's shell."""
    source = os.environ if environ is None else environ
    kept = set(keep)
    return {name: value for name, value in source.items() if name in kept or not looks_secret(name)}
