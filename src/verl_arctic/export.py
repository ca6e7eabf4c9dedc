"""A run's checkpoint out of Arctic as a Hugging Face model folder (:meth:`ArcticBackend.export`).

Arctic's main protocol exports what a training job holds: ``/save`` with ``export_hf: true`` writes the
weights with ``save_pretrained`` under ``<save dir>/hf`` and answers with that ``hf_path`` (arctic-platform 0.1.4
``common/http_server.py:496-522``, ``common/deepspeed_worker.py:606-656``); it writes no tokenizer. So a step
is exported by a training job with that step loaded (``/load-checkpoint``): a job of the export's own, made
from the run's recorded job config and destroyed after, or, while the run that saved the step is still ending
in this process (``remote_export.out``, the conformance check), that run's own training job, which Arctic
allows one of per server. The server writes into a folder beside the checkpoint, which it already writes to;
the command copies the model out of it with the tokenizer of the run's model, and removes it.

Protocol v0.1 has neither call: its ``/save-checkpoint`` takes no arguments and it cannot load a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

from verl_arctic.client import ArcticClient, ArcticError, probe_generation, probe_health
from verl_arctic.jobs import create_job, job_configs
from verl_arctic.launch import launch_server, stop_server
from verl_arctic.record import JOBS_FILE, POINTER_FILE, RUN_DIR_PREFIX
from verl_arctic.settings import ArcticSettings, check_server_size
from verl_remote import as_dict

__all__ = ["export_step"]

log = logging.getLogger(__name__)


def export_step(main_config: Any, step: int, path: str, out: str) -> None:
    """Step ``step``'s weights, saved under ``path`` by a run of ``main_config``, into the folder ``out``."""
    pointer = _pointer(path)
    arctic = ArcticSettings.of(main_config)
    generation = str(pointer.get("generation", "main"))
    if generation != "main":
        raise ValueError(
            f"the run saved step {step} on Arctic protocol {generation}, which cannot export it: its "
            "/save-checkpoint writes no Hugging Face folder and it has no load-checkpoint call to bring the step "
            "into a job that could (protocol main, arctic-platform >= 0.1.3, has both)"
        )
    server = None
    if arctic.launch and not _answers(arctic):  # the run launched its server, which ended with it
        print(f"verl-arctic: starting the Arctic server (remote_backend.comms.launch: {arctic.launch})", flush=True)
        server = launch_server(arctic.launch, arctic.url, arctic.startup_timeout, arctic.launch_env)
    try:
        if server is None:
            _reachable(arctic)
        client = arctic.client("main")
        try:
            check_server_size(client, as_dict(main_config.remote_backend))
            with _training_job(client, main_config, path, arctic.job_ready_timeout) as job:
                _export_with(client, job, main_config, step, path, out)
        finally:
            client.close()
    finally:
        if server is not None:
            stop_server(server)


def _pointer(path: str) -> dict[str, Any]:
    file = os.path.join(path, POINTER_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{file} is missing: this checkpoint was not saved by verl-arctic")
    with open(file) as fp:
        return dict(json.load(fp))


def _answers(arctic: ArcticSettings) -> bool:
    try:
        probe_health(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
    except ArcticError:
        return False
    return True


def _reachable(arctic: ArcticSettings) -> None:
    """The server answers and speaks main; otherwise ``ValueError`` saying what to start."""
    try:
        probe_health(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
        generation = probe_generation(arctic.url, timeout=arctic.connect_timeout, headers=arctic.headers)
    except ArcticError as exc:
        raise ValueError(
            f"{exc}: the Arctic server that holds the run's checkpoints exports them; start it at "
            f"{arctic.url} (remote_backend.comms.url, as the run recorded it)"
        ) from None
    if generation != "main":
        raise ValueError(f"the Arctic server at {arctic.url} speaks protocol {generation} now, which cannot export")


@contextlib.contextmanager
def _training_job(client: ArcticClient, main_config: Any, path: str, timeout: float) -> Iterator[int]:
    """The training job that exports: the run's own while it ends in this process, else one made and destroyed."""
    own = _this_process_run_job(client, main_config)
    if own is not None:
        yield own
        return
    body = job_configs(main_config, "main")["training"]
    body["checkpoint_path"] = os.path.join(path, RUN_DIR_PREFIX + "export-" + uuid.uuid4().hex)
    try:
        made = create_job(client, "training", body)
    except ArcticError as exc:
        if exc.status == 409:  # the server is busy, not the export broken: a refusal (exit 2)
            raise ValueError(str(exc)) from None
        raise
    try:
        client.wait_running(made, timeout)
        yield made
    finally:
        try:
            client.destroy(made, "training")
        except ArcticError as exc:
            log.warning("verl-arctic: could not destroy the export's training job %d: %s", made, exc)
        shutil.rmtree(body["checkpoint_path"], ignore_errors=True)


def _this_process_run_job(client: ArcticClient, main_config: Any) -> int | None:
    """The training job of the run whose record is in its folder, when this process is that run (its end, or the
    conformance check); ``ValueError`` when another live process is: it is still training."""
    record = os.path.join(str(main_config.trainer.default_local_dir), JOBS_FILE)
    if not os.path.isfile(record):
        return None
    with open(record) as fp:
        left = json.load(fp)
    training = dict(left.get("jobs") or {}).get("training")
    pid = int(left.get("pid", 0))
    if training is None or str(left.get("url", "")).rstrip("/") != client.url:
        return None
    if pid == os.getpid():
        return int(training)
    if pid and _alive(pid):
        raise ValueError(
            f"the run is still going (process {pid} holds its training job {training} on {client.url}): export "
            "once it ends, or set remote_export.out for the run to export its last step itself"
        )
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _export_with(client: ArcticClient, job: int, main_config: Any, step: int, path: str, out: str) -> None:
    """Load ``step`` into ``job``, save it with ``export_hf`` into a folder beside the checkpoint, and copy the
    model from there into ``out``, with the run's tokenizer."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    loaded = client.load_checkpoint(job, os.path.join(path, "arctic"), step)
    if int(loaded.get("global_step", 0)) == 0:
        raise ValueError(
            f"the Arctic server at {client.url} found no checkpoint of step {step} under {path}/arctic (the server "
            "reads it from its own disk: export on a machine that sees the run's folder at the same path)"
        )
    scratch = tempfile.mkdtemp(prefix=".arctic-export-", dir=path)
    try:
        saved = client.save(job, scratch, step, export_hf=True)
        hf = saved.get("hf_path")
        if not hf or not os.path.isdir(str(hf)):
            raise ValueError(
                f"the Arctic server at {client.url} answered /save with export_hf without a Hugging Face folder "
                f"(hf_path {hf!r}); it needs arctic-platform >= 0.1.3"
            )
        for name in os.listdir(str(hf)):
            shutil.copy2(os.path.join(str(hf), name), os.path.join(out, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    model = main_config.actor_rollout_ref.model
    transformers_logging.disable_progress_bar()
    AutoTokenizer.from_pretrained(str(model.get("tokenizer_path") or model.path)).save_pretrained(out)
