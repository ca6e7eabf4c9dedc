"""The conformance checks (``verl_remote.testing.check_backend``) on verl-arctic against the Arctic test server,
both protocol generations, on one Ray instance in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import arctic_jobs, live_actors

pytestmark = pytest.mark.train


def test_verl_arctic_passes_the_conformance_checks_that_its_protocol_allows(
    arctic_server: tuple[str, str], ray_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl_remote.testing import check_backend
    from verl_remote.testing.gradient import every_loss

    monkeypatch.chdir(tmp_path)  # the check's checkpoints go to its own folder, never the working directory

    url, generation = arctic_server
    # On main, separate engines (the sampler keeps its weights while the trainer updates: the overlap check);
    # on v0.1 colocated ones, the default, which decline overlapped runs.
    engines = ["remote_backend.colocate=false"] if generation == "main" else []
    overrides = [f"remote_backend.comms.api={generation}", f"remote_backend.comms.url={url}", *engines]
    # On main, every loss verl has through the gradient check (one policy loss at a time, then the aggregations
    # and the KL loss): the single pass where Arctic's verl_grpo is verl's loss, the carried gradient elsewhere.
    results = check_backend("arctic", overrides, losses="all" if generation == "main" else None)
    lines = "\n".join(result.line() for result in results)
    failed = [result.name for result in results if not result.ok and not result.skipped]
    [overlap] = [result for result in results if result.name == "overlap"]
    [gradient] = [result for result in results if result.name == "gradient"]
    [export] = [result for result in results if result.name == "export"]
    if generation == "main":
        assert failed == [], lines
        assert overlap.detail.startswith("max difference"), lines
        assert gradient.detail.startswith(f"{len(every_loss())} losses: verl's update within "), lines
        # The checkpoint out as a Hugging Face folder through /save with export_hf, by the run's own training job
        # (Arctic runs one per server), its log-probs the server's at the save.
        assert export.detail.startswith("max difference"), lines
    else:
        # Arctic's v0.1 protocol has no load-checkpoint call: the one check it cannot pass, in the backend's words.
        assert failed == ["checkpoint"], lines
        assert "has no load-checkpoint call, so a run cannot resume on it" in lines
        assert overlap.skipped and gradient.skipped and export.skipped  # they need a checkpoint loaded
    # destroy asked the server for the jobs it made (left_on_service): none is left.
    [destroy] = [result for result in results if result.name == "destroy"]
    assert destroy.ok and destroy.detail == "twice, nothing left here nor on the service", lines
    assert live_actors() == []
    assert arctic_jobs(url) == {}  # every job the checks made is destroyed on the server
    assert list(tmp_path.iterdir()) == []
