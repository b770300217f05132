"""Test-run set-up: the device the kernels run on, and the Hypothesis profiles.

Without a CUDA GPU the kernels run in Triton's CPU interpreter, which Triton reads from
TRITON_INTERPRET when flashop's kernels are decorated (at import): it is set here, before
any test module imports flashop, and restored when the run ends.
"""

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")


def _import_torchs_mkldnn_quietly():
    """torch.utils.mkldnn, which Inductor imports, decorates 14 methods with
    ``torch.jit.script_method``, which torch 2.13 deprecates: a DeprecationWarning from
    torch's own code for each, in every process that compiles. It is imported here once with
    that warning ignored; the warning stays on everywhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated",
                                category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401


_import_torchs_mkldnn_quietly()

settings.register_profile(
    "ci", max_examples=30, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", max_examples=100, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "gpu", max_examples=100, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# a quarter of the gpu profile's examples, for spreading them over processes that each take
# another --hypothesis-seed (one gpu-profile example of the slowest tests takes seconds)
settings.register_profile(
    "gpu-shard", max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"))


def _draw_without_local_constants():
    """Hypothesis (6.131 on) mixes the literals of every loaded module outside site-packages
    into its draws, so a derandomized test drew other examples depending on which modules the
    tests before it in the same process had imported (benchmarks/decode.py's lengths, imported
    by test_decode_model.py, changed test_decode.py's draws). Under the ci profile they are
    left out, so that its examples are the same in any order (tests/test_draws.py counts
    them)."""
    try:
        from hypothesis.internal.conjecture import providers
        none = providers.Constants()
    except (ImportError, AttributeError):  # a Hypothesis without them
        return
    providers._get_local_constants = lambda: none


if settings._current_profile == "ci":
    _draw_without_local_constants()


def _patch_the_language_once_per_launch():
    """Under Triton's interpreter, every call of a ``@triton.jit`` helper from inside a kernel
    patches triton.language again (``_patch_lang``: ``inspect.getmembers`` of the language
    modules, about 2 ms a call), although the launch running the kernel patched the same
    modules already and keeps them patched until it returns. That was 40% of the property
    tests' time (29,000 helper calls in one test's 150 s). Inside a launch, a helper whose
    module sees no language module the launch did not patch now skips it; launches and
    everything else run as Triton wrote them. The kernels compute the same bits
    (tests/test_config.py checks it)."""
    try:
        from triton.runtime import interpreter
        patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
        scope_type = interpreter._LangPatchScope
    except (ImportError, AttributeError):  # another Triton: keep its interpreter as it is
        return
    import triton.language as tl

    patched = [frozenset()]  # the language modules the running launch has patched

    def languages(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_once(fn):
        wanted = languages(fn)
        if wanted and wanted <= patched[-1]:
            return scope_type()  # nothing to restore
        scope = patch_lang(fn)
        patched[-1] = patched[-1] | wanted
        return scope

    def launch(self, *args, **kwargs):
        patched.append(frozenset())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    interpreter._flashop_patch_once = (patch_lang, grid_call)  # the originals, for the test


def pytest_configure(config):
    if not torch.cuda.is_available() and _SAVED_INTERPRET is None:
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_the_language_once_per_launch()


def pytest_unconfigure(config):
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(autouse=True)
def _no_plans_from_earlier_tests():
    """Each test starts without the eager path's plans (flashop/_launch/plans.py): a test
    that watches the launchers' choices sees them on its first call of a signature, whatever
    ran before it in the process."""
    from flashop._launch import plans

    plans.clear_plans()


def pytest_report_header(config):
    import flashop

    where = "Triton CPU interpreter" if flashop.INTERPRETING else torch.cuda.get_device_name()
    return [f"flashop kernels on: {where}; hypothesis profile: {settings._current_profile}"]
