"""The local backend, failing where remote_backend.fail_in says, recording each destroy()."""

from __future__ import annotations

import os
from typing import Any

from verl_remote.backends.local.backend import LocalBackend
from verl_remote.backends.local.worker import LocalForwarderWorker


class InjectedFailure(RuntimeError):
    pass


class FaultyBackend(LocalBackend):
    settings: dict[str, Any]

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> FaultyBackend:
        backend = super().from_config(main_config, handle=handle)
        assert isinstance(backend, FaultyBackend)
        backend.settings = dict(main_config.remote_backend)
        return backend

    def _maybe_fail(self, where: str) -> None:
        if self.settings.get("fail_in") == where:
            raise InjectedFailure(f"faulty backend: injected failure in {where}")

    def forward_backward(self, batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        self._maybe_fail("forward_backward")
        return super().forward_backward(batch, meta)

    async def destroy(self) -> None:
        log = self.settings.get("destroy_log")
        if log:
            with open(log, "a") as fp:
                fp.write(f"destroy pid={os.getpid()}\n")
        await super().destroy()


class FaultyWorker(LocalForwarderWorker):
    pass
