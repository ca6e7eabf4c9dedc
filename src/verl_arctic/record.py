"""The dead-run record: the jobs a run created, kept in its checkpoint folder (``arctic_jobs.json``) until they
are destroyed, and the clean-up that destroys what a run killed before it could do so left on the server, when
the server shows those jobs are that run's own (see ``ArcticBackend.write_record``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from verl_arctic.client import ArcticClient, ArcticError

__all__ = ["JOBS_FILE", "POINTER_FILE", "RUN_DIR_PREFIX", "clean_up_after_a_dead_run"]

log = logging.getLogger(__name__)

#: In the run's checkpoint folder while the run's jobs exist (see ArcticBackend.write_record).
JOBS_FILE = "arctic_jobs.json"

#: Beside the server's checkpoint of a step, in verl's checkpoint folder: the step, the server, the protocol.
POINTER_FILE = "arctic_checkpoint.json"

#: The training job's ``checkpoint_path`` is ``<checkpoint folder>/<RUN_DIR_PREFIX><run id>``: a folder no other
#: run sends, so that a recorded job can be told from another run's job with the same id
#: (see :func:`_why_not_proven`).
RUN_DIR_PREFIX = "arctic-run-"


def _answer(client: ArcticClient, job_id: int) -> dict[str, Any] | None:
    """The server's ``/job`` answer, or None when it holds no such job."""
    try:
        return client.job(job_id)
    except ArcticError as exc:
        if exc.status == 404:
            return None
        raise


def _why_not_proven(
    left: dict[str, Any], jobs: dict[str, int], answers: dict[str, dict[str, Any] | None]
) -> str | None:
    """None when the recorded jobs the server still holds are the dead run's own; otherwise why they may not be.

    Arctic hands out job ids from 1 again after a restart, so a recorded id alone proves nothing. What Arctic
    echoes of a job (both generations: ``job_info`` at the end of ``/initialize``) is its type, its model and, for
    the training job only, ``<the checkpoint_path sent>/arctic_rl_job_<id>``; the path sent is unique to the run
    (``RUN_DIR_PREFIX``). So the training job proves itself, and the others are proven by it: ids are never
    reused within one server process, the record names one server, and a run creates its training job last, so
    a sampling or log-prob job recorded with a smaller id on the server that holds the proven training job is
    the same run's.
    """
    sent = left.get("checkpoint_path")
    training = jobs.get("training")
    if not sent or training is None:
        return "the record is from a run that did not record what proves its jobs"
    info = answers.get("training")
    if info is None:
        return f"its training job {training} is gone, so nothing proves the others are the run's own"
    expected = os.path.join(str(sent), f"arctic_rl_job_{training}")
    if info.get("job_type") != "training" or str(info.get("checkpoint_path")) != expected:
        return (
            f"job {training} on the server is not the recorded run's (its checkpoint_path is "
            f"{info.get('checkpoint_path')!r}, the recorded run's is {expected!r}): the server restarted and another "
            "run holds that id"
        )
    for kind, job in jobs.items():
        answer = answers.get(kind)
        if kind == "training" or answer is None:
            continue
        if job >= training or answer.get("job_type") != kind or answer.get("model_name") != left.get("model_name"):
            found = f"{answer.get('job_type')}, {answer.get('model_name')}"
            return f"{kind} job {job} on the server does not match the record ({found})"
    return None


def clean_up_after_a_dead_run(client: ArcticClient, record: str) -> None:
    """Destroy the jobs a run that ended without destroying them left on this server, when the server shows
    they are that run's own (:func:`_why_not_proven`); leave them otherwise, saying so in one line each.

    ``verl-remote train`` holds the checkpoint folder for its run, so a record there belongs to a run that is
    gone. Jobs on another server are not touched: the message says how to remove them.
    """
    if not os.path.isfile(record):
        return
    with open(record) as fp:
        left = json.load(fp)
    jobs = {str(kind): int(job) for kind, job in dict(left.get("jobs") or {}).items()}
    if str(left.get("url", "")).rstrip("/") != client.url:
        raise ValueError(
            f"{record}: a run that did not end cleanly left Arctic jobs {jobs} on {left.get('url')}, not on "
            f"{client.url}; destroy them there (POST {left.get('url')}/destroy?job_id=<id> with "
            '{"job_type": "<type>"}) and delete that file, or use another trainer.default_local_dir'
        )
    answers = {kind: _answer(client, job) for kind, job in jobs.items()}
    doubt = _why_not_proven(left, jobs, answers)
    for kind, job in jobs.items():
        if answers[kind] is None:
            continue  # gone already (the server restarted, or someone removed it)
        if doubt is not None:
            log.warning(
                "verl-arctic: left %s job %d on %s alone although %s records it: %s; if it is that dead run's, "
                "destroy it with POST %s/destroy?job_id=%d and the body {\"job_type\": \"%s\"}",
                kind, job, client.url, record, doubt, client.url, job, kind,
            )  # fmt: skip
            continue
        client.destroy(job, kind)
        log.warning(
            "verl-arctic: destroyed %s job %d on %s, left by a run that did not end cleanly", kind, job, client.url
        )
    os.unlink(record)
