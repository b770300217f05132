"""The FLASHOP_* switches: read from the environment once, changed for a block by
flashop.config.override."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashop
from flashop import config


def test_override_changes_a_switch_for_the_block_and_restores_it():
    before = config.settings.tma
    with config.override(tma=False, dq_atomics=True) as settings:
        assert settings is config.settings
        assert (config.settings.tma, config.settings.dq_atomics) == (False, True)
    assert (config.settings.tma, config.settings.dq_atomics) == (before, None)
    with pytest.raises(RuntimeError), config.override(autotune=True):
        raise RuntimeError("inside")
    assert config.settings.autotune is False


def test_override_names_the_switches_when_given_an_unknown_one():
    with pytest.raises(TypeError, match=r"unknown switch\(es\) \['tme'\]; the switches are "
                                        r"autotune, tma, warp_specialize, gluon, dq_atomics, "
                                        r"direct_eager, cached_launch, cpu_path"):
        with config.override(tme=False):
            pass


def test_switches_are_read_from_the_environment_at_import():
    code = ("import flashop.config as c; s = c.settings; "
            "print(s.autotune, s.tma, s.warp_specialize, s.gluon, s.dq_atomics, s.direct_eager, "
            "s.cached_launch, s.cpu_path)")
    env = {"FLASHOP_AUTOTUNE": "1", "FLASHOP_TMA": "0", "FLASHOP_WS": "1", "FLASHOP_GLUON": "0",
           "FLASHOP_DQ_ATOMICS": "1", "FLASHOP_DIRECT_EAGER": "0", "FLASHOP_CACHED_LAUNCH": "0",
           "FLASHOP_CPU_PATH": "1", "TRITON_INTERPRET": "1"}
    # the child imports flashop from the repository root, wherever pytest was started
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, cwd=root)
    assert done.stdout.split() == ["True", "False", "True", "False", "True", "False", "False",
                                   "True"]
    done = subprocess.run([sys.executable, "-c", code], env={"TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, check=True, cwd=root)
    assert done.stdout.split() == ["False", "None", "None", "None", "None", "True", "True",
                                   "False"]


@pytest.mark.skipif(not flashop.INTERPRETING, reason="Triton's interpreter only")
def test_patching_the_language_once_per_launch_changes_no_bits(monkeypatch):
    """tests/conftest.py lets a launch patch triton.language once for all the helpers its
    kernel calls; the kernels give the same bits as with Triton's own patching (a call of
    every modifier, forward and backward, with dQ by atomics and without)."""
    from triton.runtime import interpreter

    from helpers import Case, make_inputs, make_modifiers, run_flashop

    assert hasattr(interpreter, "_flashop_patch_once")  # in effect on this Triton
    case = Case(2, 37, 45, 2, 2, 16, 8, torch.bfloat16, causal=True, window_size=(20, 0),
                softcap=5.0, alibi=(4,), gate=torch.float32, mask=torch.float32,
                mask_shape=(1, 4, 37, 45), mask_grad=True, sinks=torch.float32)
    inputs, dout, dlse = make_inputs(case)
    mods = make_modifiers(case)

    def results():
        torch.manual_seed(0)
        return [t for atomics in (True, False)
                for out, lse, grads in [run_flashop(case, inputs, dout, dlse, mods, atomics)]
                for t in (out, lse, *grads)]

    once = results()
    patch_lang, grid_call = interpreter._flashop_patch_once
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", grid_call)
    every_call = results()
    assert all(torch.equal(a, b) for a, b in zip(once, every_call, strict=True))
