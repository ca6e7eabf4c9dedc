"""What verl-remote adds to `import verl`, in fresh processes.

verl loads every `verl.plugins` entry point at the end of `import verl`, in every
process of a run (driver, TaskRunner, each Ray worker), so the plugin's cost is
paid many times. Two measurements, each the median over fresh interpreters:

1. direct: in a process where verl loaded no plugin, the time to load the
   `verl_remote` entry point exactly as verl does (`EntryPoint.load()`);
2. end to end: the wall time of `import verl` with the plugin
   (VERL_USE_EXTERNAL_PLUGINS=verl_remote) and without it (a name that matches
   no plugin, so verl still scans the entry points but loads nothing), the runs
   interleaved so that drift hits both sides alike.

The target is under 5 ms for (1). (2) is reported for context: `import verl`
itself takes seconds, and its run-to-run noise is larger than the plugin.

    python benchmarks/plugin_import.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TARGET_MS = 5.0

DIRECT = """
import json, time
import verl  # plugins disabled by the environment
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="verl.plugins") if e.name == "verl_remote"]
start = time.perf_counter()
ep.load()
elapsed = time.perf_counter() - start
import verl_remote.integration.verl_plugin as plugin
assert plugin.is_registered()
print(json.dumps(elapsed))
"""

END_TO_END = """
import json, sys, time
start = time.perf_counter()
import verl
elapsed = time.perf_counter() - start
print(json.dumps([elapsed, "verl_remote.integration.verl_plugin" in sys.modules]))
"""


def _run(code: str, plugins: str) -> object:
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per measurement (default 15)")
    args = parser.parse_args()

    direct_ms = []
    with_ms, without_ms = [], []
    for i in range(args.runs):
        direct_ms.append(1000 * float(_run(DIRECT, "none")))  # type: ignore[arg-type]
        elapsed, loaded = _run(END_TO_END, "verl_remote")  # type: ignore[misc]
        assert loaded, "verl did not load verl_remote.integration.verl_plugin"
        with_ms.append(1000 * elapsed)
        elapsed, loaded = _run(END_TO_END, "no_plugin_by_this_name")  # type: ignore[misc]
        assert not loaded
        without_ms.append(1000 * elapsed)
        print(
            f"run {i + 1}/{args.runs}: plugin {direct_ms[-1]:.3f} ms; import verl {with_ms[-1]:.0f} ms with, "
            f"{without_ms[-1]:.0f} ms without",
            file=sys.stderr,
            flush=True,
        )

    direct = statistics.median(direct_ms)
    with_, without = statistics.median(with_ms), statistics.median(without_ms)
    print(f"verl-remote plugin import cost, median of {args.runs} fresh processes")
    print()
    print("| measurement | median | min | max |")
    print("|---|---|---|---|")
    spread = f"{min(direct_ms):.3f} ms | {max(direct_ms):.3f} ms"
    print(f"| plugin load (EntryPoint.load, as verl does it) | {direct:.3f} ms | {spread} |")
    print(f"| `import verl` with the plugin | {with_:.0f} ms | {min(with_ms):.0f} ms | {max(with_ms):.0f} ms |")
    print(
        f"| `import verl` without the plugin | {without:.0f} ms | {min(without_ms):.0f} ms | {max(without_ms):.0f} ms |"
    )
    print(f"| difference of medians | {with_ - without:+.0f} ms | | |")
    print()
    verdict = "meets" if direct < TARGET_MS else "MISSES"
    print(f"plugin load {direct:.3f} ms {verdict} the {TARGET_MS:.0f} ms target")
    return 0 if direct < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
