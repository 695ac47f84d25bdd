"""jax.export of programs using jax_blink: export / serialize / deserialize / call round
trips on the 8 host CPU devices, with the native custom call (``jax_blink.export_checks()``) and
with the portable ppermute lowering (no checks to disable), also of a ``jax_blink.transform``ed
function; and that jax refuses the native custom call without the checks, naming its target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blink
from jax_blink import api, lowering  # noqa: F401  (api registers the lowerings)

MESH = Mesh(np.array(jax.devices()[:8])[[3, 1, 0, 2, 7, 5, 4, 6]], ("i",))
HAVE_FFI = lowering.find_lowering("ffi", "cpu") is not None
IMPLS = ["ppermute"] + (["ffi"] if HAVE_FFI else [])


def _program(body):
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("i"), out_specs=P("i")))


def _lax_body(v):
    return lax.psum(v, "i") + lax.all_gather(v, "i", tiled=True)[: v.shape[0]] * 2.0


@pytest.mark.parametrize("how", ["api", "transform"])
@pytest.mark.parametrize("impl", IMPLS)
def test_export_round_trip(impl, how):
    x = jax.device_put(jnp.arange(8 * 6, dtype=jnp.float32) / 3.0, NamedSharding(MESH, P("i")))
    if how == "api":
        f = _program(lambda v: jax_blink.psum(v, "i", impl=impl) + jax_blink.all_gather(v, "i", tiled=True,
                                                                                          impl=impl)[:6] * 2.0)
    else:
        f = _program(jax_blink.transform(_lax_body, impl=impl))
    checks = jax_blink.export_checks() if impl == "ffi" else []
    exp = jax.export.export(f, disabled_checks=checks)(x)
    text = exp.mlir_module()
    assert ("jax_blink_cpu" in text) == (impl == "ffi") and "all_reduce" not in text
    back = jax_blink.deserialize(exp.serialize())
    np.testing.assert_allclose(np.asarray(back.call(x)), np.asarray(_program(_lax_body)(x)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(back.call(x)), np.asarray(f(x)))


@pytest.mark.skipif(not HAVE_FFI, reason="the native CPU module is not built (ffi impl absent)")
def test_export_without_checks_names_the_target():
    x = jax.device_put(jnp.arange(8.0), NamedSharding(MESH, P("i")))
    f = _program(lambda v: jax_blink.psum(v, "i", impl="ffi"))
    refused = "(?s)custom calls whose targets have no compatibility guarantees.*jax_blink_cpu"
    with pytest.raises(ValueError, match=refused):
        jax.export.export(f)(x).serialize()
    assert jax_blink.export_checks() == [jax.export.DisabledSafetyCheck.custom_call("jax_blink_cpu"),
                                                       jax.export.DisabledSafetyCheck.custom_call("jax_blink_cuda")]
