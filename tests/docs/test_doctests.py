"""The runnable examples in the docstrings of the public entry points (doctest, exact outputs; the
8 host CPU devices that ``jax_blink.psum``'s example needs come from conftest.py)."""

import doctest
import importlib

import pytest

# module -> the docstrings that must hold an example (every example of the module runs)
EXAMPLES = {
    "jax_blink.planning": ["plan"],
    "jax_blink.schedule": ["build_schedule", "execute"],
    "jax_blink.topology.model": ["Topology.subset"],
    "jax_blink.api": ["psum"],
    "jax_blink.explaining": ["explain", "lowered_text"],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert {f"{name}.{q}" for q in EXAMPLES[name]} <= {t.name for t in tests}, [t.name for t in tests]
    out = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t, out=out.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(out)
    assert result.attempted >= len(EXAMPLES[name])
