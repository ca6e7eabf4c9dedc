"""``python -m verl_remote_tinker.local_server``: SkyRL's Tinker server on this machine, for the demo and the tests.

The command's name; the tool is :mod:`verl_remote_tinker.testing.local_server`.
"""

from __future__ import annotations

import sys

from verl_remote_tinker.testing.local_server import main

if __name__ == "__main__":
    sys.exit(main())
