"""The API key a run sends (``remote_backend.api_key_env`` or ``api_key_file``), and what is refused or warned
about before Ray: a hosted service without a key, a key over plain http, an SDK the hosted service refuses."""

from __future__ import annotations

import importlib.metadata
import os
import urllib.parse
from typing import Any

from verl_remote import read_token, token_in_clear

__all__ = [
    "HOSTED_DOMAINS",
    "HOSTED_SDK_FLOOR",
    "NO_KEY",
    "OPEN_SERVERS_SDK",
    "api_key",
    "credentials_problem",
    "hosted_sdk_problem",
    "sdk_reach",
]

#: Sent as the API key when no key is set (a local server checks none; the SDK refuses an empty one).
NO_KEY = "tml-no-key-set"

#: The domain of Thinking Machines' hosted Tinker (the SDK's default base URL, tinker 0.25 and 0.38
#: ``_client.py``: https://tinker.thinkingmachines.dev/services/tinker-prod), which answers nothing without a key.
HOSTED_DOMAINS = ("thinkingmachines.dev",)

#: The oldest tinker SDK hosted Tinker accepts (it refuses 0.27 and older), and the range it accepts with a
#: deprecation warning (0.29 to 0.32); issue 55 of this project, from the hosted service's answers.
HOSTED_SDK_FLOOR = (0, 28)
HOSTED_SDK_WARNED = ((0, 29), (0, 32))
#: What the open Tinker servers pin: SkyRL's (skyrl 0.4.0, ``tinker<0.26``) and the others that pin below 0.26.
OPEN_SERVERS_SDK = "<0.26"
#: The SDKs that reach hosted Tinker without a warning, within this distribution's range.
HOSTED_SDK = ">=0.33,<0.39"


def _installed_sdk() -> tuple[str, tuple[int, int]] | None:
    """The installed tinker SDK's version, and its (major, minor); None where it is not installed or unreadable."""
    from packaging.version import InvalidVersion, Version

    try:
        text = importlib.metadata.version("tinker")
        release = Version(text).release
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None
    return text, (release[0], release[1] if len(release) > 1 else 0)


def hosted_sdk_problem(url: str) -> tuple[str | None, str | None]:
    """(a refusal, a warning) for the installed tinker SDK against ``url``: hosted Tinker refuses 0.27 and older
    (the run would fail at its first call, after Ray and verl started) and warns on 0.29 to 0.32."""
    installed = _installed_sdk()
    if not _hosted(url) or installed is None:
        return None, None
    text, at = installed
    if at < HOSTED_SDK_FLOOR:
        return (
            f"remote_backend.base_url={url} is Thinking Machines' hosted Tinker, which refuses tinker SDK {text} (0.27 "
            f"and older): pip install 'tinker{HOSTED_SDK}' (SkyRL's and the other open Tinker servers need "
            f"tinker{OPEN_SERVERS_SDK}: keep them in an environment of their own)",
            None,
        )
    if HOSTED_SDK_WARNED[0] <= at <= HOSTED_SDK_WARNED[1]:
        return None, (
            f"remote_backend.base_url={url}: hosted Tinker deprecates tinker SDK {text} (0.29 to 0.32); "
            f"pip install 'tinker{HOSTED_SDK}'"
        )
    return None, None


def sdk_reach() -> str:
    """What the installed tinker SDK reaches, for ``verl-remote doctor``."""
    installed = _installed_sdk()
    if installed is None:
        return "the tinker SDK is not installed: pip install verl-remote-tinker"
    text, at = installed
    if at < (0, 26):
        reaches = "reaches SkyRL's and the other open Tinker servers (they pin tinker<0.26), not hosted Tinker"
    elif at < HOSTED_SDK_FLOOR:
        reaches = "reaches neither hosted Tinker (0.28 or newer) nor the open servers that pin tinker<0.26"
    else:
        reaches = "reaches hosted Tinker, not the open servers that pin tinker<0.26 (SkyRL's)"
    return (
        f"tinker SDK {text} {reaches}; hosted Tinker takes tinker{HOSTED_SDK} (0.28 or newer, 0.29 to 0.32 "
        f"deprecated), the open servers tinker{OPEN_SERVERS_SDK}"
    )


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
