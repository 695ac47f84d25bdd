"""Tests run JAX on 8 host CPU devices: the flag must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# every test plans afresh (tests of the on-disk plan cache turn it on in a temporary directory)
os.environ.setdefault("JAX_BLINK_PLAN_CACHE", "0")
# no test reads this machine's calibration (the calibration tests write their own in a temporary directory)
os.environ.setdefault("JAX_BLINK_CALIBRATION", "0")

import pathlib

import pytest

SHARED_TOPOLOGIES = pathlib.Path(__file__).resolve().parent / "data" / "topologies"


@pytest.fixture(scope="session")
def topology_dir() -> pathlib.Path:
    """Real nvidia-smi topo -m outputs (copied from shared/topologies)."""
    return SHARED_TOPOLOGIES
