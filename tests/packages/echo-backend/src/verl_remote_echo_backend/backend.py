"""The echo backend keeps its whole state in a JSON file, so any process can re-attach."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from verl_remote import RemoteBackend


class EchoBackend(RemoteBackend):
    def __init__(self, state_file: Path) -> None:
        self.state_file = state_file

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> EchoBackend:
        if handle is not None:
            return cls(Path(handle["state_file"]))
        state_dir = main_config.remote_backend.state_dir or tempfile.mkdtemp(prefix="echo-backend-")
        backend = cls(Path(state_dir) / "state.json")
        backend._write({"weights_version": 0, "destroyed": False})
        return backend

    def reconnect_handle(self) -> dict[str, Any]:
        return {"state_file": str(self.state_file)}

    def state(self) -> dict[str, Any]:
        return dict(json.loads(self.state_file.read_text()))

    def _write(self, state: dict[str, Any]) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    async def update_weights(self) -> None:
        state = self.state()
        state["weights_version"] += 1
        self._write(state)

    async def save_checkpoint(self, step: int, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / f"echo-{step}.json").write_text(json.dumps(self.state()))

    async def load_checkpoint(self, step: int, path: str) -> None:
        self._write(json.loads((Path(path) / f"echo-{step}.json").read_text()))

    async def destroy(self) -> None:
        state = self.state()
        state["destroyed"] = True
        self._write(state)
