"""Run the experiments written against compile_sm90 (offline sm_90 compiles) on a GPU: a
stand-in module ``compile_sm90`` whose ``descriptor`` makes the launcher's descriptors
(flashop._launch.gluon.descriptor_of), without compile_sm90's offline driver. Import this
module before an experiment's kernel module:

    import gpu_stand_in  # noqa: F401
    import gluon_mla_decode
"""

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flashop._launch import gluon  # noqa: E402


def descriptor(x, block):
    """A descriptor of ``x`` as it is strided, tiles ``block``."""
    return gluon.descriptor_of(x, tuple(block))


def _unavailable(*args, **kwargs):
    raise RuntimeError("gpu_stand_in: offline compiles need compile_sm90 itself")


stand_in = types.ModuleType("compile_sm90")
stand_in.descriptor = descriptor
stand_in.compile_kernel = stand_in.report = _unavailable
sys.modules["compile_sm90"] = stand_in
