"""The FSDP example (examples/flax_fsdp/train.py): parameters sharded over 8 devices, all-gathered by
jax_blink.all_gather, gradients reduce-scattered by its transpose (jax_blink.psum_scatter); every
step checked in lockstep against lax.all_gather / lax.psum_scatter from the same state."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_blink import Topology
from jax_blink.cli.demo_cmd import load_example

EPOCHS = 4


@pytest.fixture(scope="module")
def ex():
    return load_example("fsdp")


@pytest.fixture(scope="module")
def run(ex):
    return ex.train(ex.Config(epochs=EPOCHS), ex.blink_collectives(Topology.preset("dgx1v")))


@pytest.mark.slow
def test_training_reaches_accuracy_in_lockstep_with_lax(ex, run):
    assert len(run.step_losses) == len(run.lockstep_losses) == EPOCHS * (1437 // 64)
    assert run.test_accuracy >= 0.95, run.epochs
    assert run.max_rel_diff <= ex.MAX_REL_DIFF, run.max_rel_diff
    assert run.max_param_diff <= 1e-6, run.max_param_diff
    assert run.step_losses[0] > 2.0 and run.epochs[-1]["loss"] < 0.3
    assert ex.problems(run, 0.95) == []
    # each device stores 1/8 of the (padded) parameters
    assert run.nbytes_per_device * 8 >= 4 * run.nparams > run.nbytes_per_device * 7


def test_gradient_is_the_reduce_scatter_transpose(ex):
    """The step's program: the forward gathers with jax_blink, grad turns that into jax_blink's
    reduce-scatter (no lax collective moves the parameters or gradients)."""
    model, tx = ex.MLP(), ex.optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]
    layout = ex.Layout.of(params, 8)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), (ex.AXIS,))
    blocks = [jnp.asarray(v) for v in layout.shard(params)]
    opt = tx.init(blocks)
    step = ex.make_step(ex.blink_collectives(), model, tx, layout, mesh, opt)
    text = str(jax.make_jaxpr(step)(blocks, opt, jnp.zeros((64, 8, 8, 1)), jnp.zeros(64, jnp.int32)))
    assert text.count("blink_all_gather") == len(blocks)
    assert text.count("blink_reduce_scatter") == len(blocks)
    assert not re.search(r"(?<!blink_)(all_gather|reduce_scatter)\[", text)  # no lax collective


@pytest.mark.slow
def test_shortfall_is_explained(ex, run):
    msgs = ex.problems(run, 1.01)
    assert len(msgs) == 1 and "below --min-accuracy 1.01" in msgs[0] and "per epoch" in msgs[0]
