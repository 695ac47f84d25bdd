"""scripts/jax_test_suite.py's own logic, without running JAX's tests: which tests it selects (the
code, decorators' closures and absl parameters that name a substituted function) and which failures it
lists apart as lax text / name artefacts (only with the expected kind of message)."""

import importlib.util
import pathlib

_path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "jax_test_suite.py"
_spec = importlib.util.spec_from_file_location("jax_test_suite", _path)
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)


def _helper(x):
    return lax.psum(x, "i")  # noqa: F821  (never called: only its code is read)


def test_static_selection_follows_helpers_decorators_and_parameters():
    def direct():
        return lax.all_gather  # noqa: F821

    def via_helper():
        return _helper(1)

    def decorated(fn):
        def wrapper(*a):
            return fn(*a)
        return wrapper

    def unrelated():
        return lax.ppermute  # noqa: F821

    def stand_in():
        pass
    stand_in.__jax_blink_suite__ = "psum"
    params = (1, stand_in)

    def parameterized():
        return params

    assert suite._refers(direct, None)
    assert suite._refers(via_helper, None)
    assert suite._refers(decorated(via_helper), None)
    assert suite._refers(parameterized, None)
    assert not suite._refers(unrelated, None)
    assert not suite._refers(decorated(unrelated), None)


def test_artefacts_need_their_message():
    rgv3 = "AssertionError: 'replica_group_mesh_axes' not found in 'module @jit_f"
    assert suite._artefact("shard_map_test.py::ShardMapTest::test_all_gather_rgv3", rgv3)
    assert suite._artefact("shard_map_test.py::ShardMapTest::test_all_reduce_rgv3_multiple_meshes", rgv3)
    # the same test failing another way is a failure, and so is an unlisted test with that message
    assert suite._artefact("shard_map_test.py::ShardMapTest::test_all_gather_rgv3", "TypeError: bad") is None
    assert suite._artefact("shard_map_test.py::ShardMapTest::test_all_gather_rgv4", rgv3) is None
