from __future__ import annotations

from typing import Any

from verl_remote import RemoteBackend


class Backend(RemoteBackend):
    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> Backend:
        return cls()

    def reconnect_handle(self) -> dict[str, Any]:
        return {}

    async def update_weights(self) -> None:
        pass

    async def save_checkpoint(self, step: int, path: str) -> None:
        pass

    async def load_checkpoint(self, step: int, path: str) -> None:
        pass

    async def destroy(self) -> None:
        pass


class Worker:
    pass


class Replica:
    pass
