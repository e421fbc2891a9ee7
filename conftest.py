"""Eight emulated CPU devices for the doctests of spmd/ and strategies/ too (tests/conftest.py does the same),
set before anything starts JAX's backend; and the notebooks' tiers."""

import os

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# Executing a notebook takes up to a minute on two cores: the quickstart runs in the default tier, the others
# (each a longer tour of one area the tests cover) in the slow tier, unless named on the command line.
DEFAULT_NOTEBOOKS = ("01_quickstart.ipynb",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    named = {os.path.basename(arg.split("::")[0]) for arg in config.args}
    for item in items:
        name = item.path.name
        if name.endswith(".ipynb") and name not in DEFAULT_NOTEBOOKS and name not in named:
            item.add_marker(pytest.mark.slow)
