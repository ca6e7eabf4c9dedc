"""The API key a run sends (``remote_backend.api_key_env`` or ``api_key_file``), and what is refused or warned
about before Ray: a hosted service without a key, a key over plain http."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

from verl_remote import read_token, token_in_clear

__all__ = ["HOSTED_DOMAINS", "NO_KEY", "api_key", "credentials_problem"]

#: Sent as the API key when no key is set (a local server checks none; the SDK refuses an empty one).
NO_KEY = "tml-no-key-set"

#: The domain of Thinking Machines' hosted Tinker (the SDK's default base URL, tinker 0.25 and 0.38
#: ``_client.py``: https://tinker.thinkingmachines.dev/services/tinker-prod), which answers nothing without a key.
HOSTED_DOMAINS = ("thinkingmachines.dev",)


def api_key(settings: dict[str, Any]) -> str:
    """The key: ``api_key_file``'s content where it is set, else ``api_key_env``'s variable where it is not empty,
    else :data:`NO_KEY`. ``ValueError`` naming the setting for a key file missing or empty, and for a key with
    whitespace or a character that is not printable ASCII inside it (never showing the key)."""
    if settings.get("api_key_file"):
        token = read_token("remote_backend.api_key_env", None, "remote_backend.api_key_file", settings["api_key_file"])
        assert token is not None
        return token
    name = settings.get("api_key_env")
    if name and os.environ.get(str(name), "").strip():
        token = read_token("remote_backend.api_key_env", name, "remote_backend.api_key_file", None)
        assert token is not None
        return token
    return NO_KEY


def _hosted(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return any(host == domain or host.endswith("." + domain) for domain in HOSTED_DOMAINS)


def credentials_problem(url: str, settings: dict[str, Any]) -> tuple[str | None, str | None]:
    """(a refusal, a warning) for the key the run would send to ``url``: a hosted Tinker service and no key is
    refused; a key over plain http to a host that is not this machine is warned about."""
    key = api_key(settings)
    if key == NO_KEY:
        if _hosted(url):
            name = settings.get("api_key_env") or "TINKER_API_KEY"
            return (
                f"remote_backend.base_url={url} is Thinking Machines' hosted Tinker, which needs an API key, and "
                f"none is set: export {name}=<key> (remote_backend.api_key_env names the variable) or set "
                "remote_backend.api_key_file to a file holding it",
                None,
            )
        return None, None
    if token_in_clear(url):
        return None, (
            f"remote_backend.base_url={url}: the API key goes over plain http to a host that is not this machine; "
            "use https:// (or a tunnel) where the network is not yours"
        )
    return None, None
