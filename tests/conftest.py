"""Test-run set-up: the device the kernels run on, and the Hypothesis profiles.

Without a CUDA GPU the kernels run in Triton's CPU interpreter, which Triton reads from
TRITON_INTERPRET when flashop's kernels are decorated (at import): it is set here, before
any test module imports flashop, and restored when the run ends.
"""

import os

import torch
from hypothesis import HealthCheck, settings

_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")

settings.register_profile(
    "ci", max_examples=40, derandomize=True, deadline=None, print_blob=True,
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


def pytest_configure(config):
    if not torch.cuda.is_available() and _SAVED_INTERPRET is None:
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_unconfigure(config):
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)


def pytest_report_header(config):
    import flashop

    where = "Triton CPU interpreter" if flashop.INTERPRETING else torch.cuda.get_device_name()
    return [f"flashop kernels on: {where}; hypothesis profile: {settings._current_profile}"]
