"""jax_blink.all_gather / psum_scatter against lax.all_gather / lax.psum_scatter on 8 CPU devices:
every axis / tiled combination, every dtype psum takes, 1-D / 2-D / permuted meshes, pytrees and
zero-size leaves, axis_index_groups, grad (each one's transpose is the other), vmap (over the
collective axis and over a batch dimension), scan, pmap, shard_map with check_vma on and off (vma
typing as lax), lax's shape errors; ppermute and (where built) ffi lowerings. Integers bitwise,
floats to rounding.

The cases (tests/allgather_cases.py) run in a subprocess per batch with a time limit, like
tests/test_rendezvous.py (which also runs all-gather / reduce-scatter next to XLA collectives).
"""

import importlib.util
import pathlib

import numpy as np
import pytest
from test_rendezvous import check_batch

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "allgather_cases.py"
_spec = importlib.util.spec_from_file_location("allgather_cases", WORKER)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.mark.parametrize("batch", cases.BATCHES)
def test_batch(batch):
    check_batch(batch, cases, WORKER)


def test_planless_shape_rules_match_lax():
    """The shape rules alone (no devices): lax.all_gather / psum_scatter output shapes."""
    from jax_blink import primitives
    assert primitives.all_gather_shape((3, 4), 1, 8, False) == (3, 8, 4)
    assert primitives.all_gather_shape((3, 4), 1, 8, True) == (3, 32)
    assert primitives.reduce_scatter_shape((8, 5), 0, 8, False) == (5,)
    assert primitives.reduce_scatter_shape((3, 16), 1, 8, True) == (3, 2)
    for shape, dim, tiled in (((7, 5), 0, False), ((3, 12), 1, True), ((8,), 1, False)):
        with pytest.raises(ValueError):
            primitives.reduce_scatter_shape(shape, dim, 8, tiled)
    assert np.prod(primitives.all_gather_shape((0, 4), 0, 8, True)) == 0
