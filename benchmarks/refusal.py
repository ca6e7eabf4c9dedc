"""How fast `verl-remote train` refuses bad input, and that a refused run writes nothing.

A refusal is the whole of what a user waits for after a typo, so it must come in seconds: the target is the
message within 3 s of the start and the process gone within 1 s of the message, on a 2-core machine that is
otherwise idle. Each case is run in a fresh process, in an empty folder that must stay empty; the median over
the runs is reported.

    python benchmarks/refusal.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESSAGE_TARGET_S = 3.0
EXIT_TARGET_S = 1.0

#: A run's own model and data, written by :func:`own_inputs` into the benchmark's folder ``{own}``.
OWN = ["actor_rollout_ref.model.path={own}/model", "data.train_files={own}/train.parquet"]
#: (what, overrides): a type refusal, a range refusal, an unknown key, an unknown backend, and the user's own data
#: refused before Ray: without a reward for its data_source, beside the demo's reward.
CASES = [
    ("a type (rollout.n=two)", ["actor_rollout_ref.rollout.n=two"]),
    ("a range (rollout.n=0)", ["actor_rollout_ref.rollout.n=0"]),
    ("an unknown key", ["remote_backend=arctic", "remote_backend.url=http://127.0.0.1:7000"]),
    ("an unknown backend", ["remote_backend=arcitc"]),
    ("your data, no reward", [*OWN, "data.val_files={own}/train.parquet"]),
    ("your data, the demo's reward", [*OWN, "data.val_files={own}/train.parquet", "--recipe", "demo"]),
    # A service where nothing answers, asked before verl is imported (RemoteBackend.probe_service).
    ("an Arctic URL, no answer", ["remote_backend=arctic", "remote_backend.comms.url=http://127.0.0.1:{dead}"]),
    ("a Tinker URL, no answer", ["remote_backend=tinker", "remote_backend.base_url=http://127.0.0.1:{dead}"]),
]


def own_inputs(folder: Path) -> None:
    """A model folder (its config.json is all a refusal reads) and a data file in verl's RL format."""
    import pandas as pd

    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    row = {
        "data_source": "my_task",
        "prompt": [{"role": "user", "content": "2 + 3?"}],
        "reward_model": {"ground_truth": "5"},
    }
    pd.DataFrame([row] * 64).to_parquet(folder / "train.parquet")


def dead_port() -> int:
    """A port of this machine where nothing listens (free a moment ago)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def script() -> str:
    found = shutil.which("verl-remote", path=str(Path(sys.executable).parent)) or shutil.which("verl-remote")
    if found is None:
        raise SystemExit("refusal.py: the verl-remote console script is not installed beside this Python")
    return found


def once(overrides: list[str], own: Path) -> tuple[float, float, int, str, list[str]]:
    """(seconds to the refusal's line, seconds from it to the exit, exit code, the line, what the run wrote)."""
    options = [overrides[i + 1] for i, word in enumerate(overrides) if word == "--recipe"]
    words = [
        w.format(own=own, dead=dead_port())
        for i, w in enumerate(overrides)
        if w != "--recipe" and overrides[i - 1] != "--recipe"
    ]
    with tempfile.TemporaryDirectory() as folder:
        start = time.monotonic()
        proc = subprocess.Popen(
            [
                script(),
                "train",
                *(f"--recipe={o}" for o in options),
                *words,
                f"trainer.default_local_dir={folder}/ckpt",
            ],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stderr is not None
        line, said = "", None
        for text in proc.stderr:
            if text.startswith("verl-remote train:"):
                line, said = text.strip(), time.monotonic()
                break
        proc.stderr.read()
        code = proc.wait()
        ended = time.monotonic()
        said = said if said is not None else ended
        wrote = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))
    return said - start, ended - said, code, line, wrote


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results, ok = [], True
    own = Path(tempfile.mkdtemp(prefix="refusal-inputs-"))
    own_inputs(own)
    for what, overrides in CASES:
        runs = [once(overrides, own) for _ in range(args.runs)]
        message = statistics.median(r[0] for r in runs)
        exit_after = statistics.median(r[1] for r in runs)
        codes = sorted({r[2] for r in runs})
        wrote = sorted({w for r in runs for w in r[4]})
        passed = message <= MESSAGE_TARGET_S and exit_after <= EXIT_TARGET_S and codes == [2] and not wrote
        ok = ok and passed
        results.append(
            {
                "case": what,
                "message_s": round(message, 2),
                "exit_after_message_s": round(exit_after, 2),
                "exit_codes": codes,
                "wrote": wrote,
                "line": runs[-1][3][:160],
                "within_target": passed,
            }
        )
        print(
            f"{what:28} message {message:5.2f} s, exit {exit_after:4.2f} s after it, exit code {codes}, "
            f"wrote {wrote or 'nothing'}{'' if passed else '  <- over target'}",
            flush=True,
        )
    shutil.rmtree(own)
    print(json.dumps({"runs": args.runs, "cpus": os.cpu_count(), "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
