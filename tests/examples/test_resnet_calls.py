"""The Flax ResNet-with-BatchNorm step of benchmarks/resnet_step.py (small: two stages of one block, width
4, 8x8 images) through jax_blink.transform and through the jax_blink.pmean rename: no more jax_blink
calls than XLA's all-reduces in lax's compiled step, none of XLA's left after the transform, losses
within 1e-5 relative of lax's."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from jax_blink import api, lowering  # noqa: E402,F401  (api registers the lowerings)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "resnet_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("resnet_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Flax's module dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_resnet_step_calls_and_losses():
    if lowering.find_lowering("ffi", "cpu") is None:
        pytest.skip("the native CPU module is not built (its custom calls are what is counted)")
    rs = _load()
    state, batches, make_step = rs.setup(width=4, image=8, batch=2, stages=(1, 1), steps=1)
    fns = rs.variants(make_step)
    x, y = batches[0]
    compiled = {k: f.lower(*state, x, y).compile() for k, f in fns.items()}  # each compiled once
    xla = len(rs.ALL_REDUCE.findall(compiled["lax"].as_text()))
    # stem + 2 blocks x 2 + 1 projection = 6 BatchNorms; the projection's statistics combine with its
    # block's second ones: 5 forward levels, 5 backward, 1 for the gradients and the loss
    assert xla == 11
    out = {k: c(*state, x, y) for k, c in compiled.items()}
    for name in ("transform", "rename"):
        text = compiled[name].as_text()
        calls = len(rs.BLINK_CALL.findall(text))
        assert 1 <= calls <= xla, (name, calls, xla)
        if name == "transform":
            assert calls == xla and not rs.ALL_REDUCE.findall(text)
        np.testing.assert_allclose(np.asarray(out[name][3]), np.asarray(out["lax"][3]), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(out[name][0]), jax.tree.leaves(out["lax"][0])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
