"""verl-remote-tinker's build hook: the one every distribution under dists/ shares (../hatch_build.py in a
checkout; the sdist carries a copy as _shared_hatch_build.py)."""

from pathlib import Path
from runpy import run_path

HERE = Path(__file__).resolve().parent
_SHARED = HERE / "_shared_hatch_build.py"
globals().update(run_path(str(_SHARED if _SHARED.is_file() else HERE.parent / "hatch_build.py"), {"HERE": HERE}))
