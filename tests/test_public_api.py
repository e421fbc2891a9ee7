"""Every public name of spmd and strategies has a docstring with a runnable example (the doctests run in the
suite), and every public namespace says what it holds."""

import importlib
import inspect

import pytest

NAMESPACES = (
    "spmd",
    "spmd.axes",
    "spmd.collectives",
    "spmd.costmodel",
    "spmd.devices",
    "spmd.execution",
    "spmd.models",
    "spmd.pipeline",
    "spmd.rules",
    "spmd.data",
    "strategies",
    "strategies.hetero",
    "strategies.suggest",
)


def _public(namespace: str) -> list[tuple[str, object]]:
    module = importlib.import_module(namespace)
    return [(name, getattr(module, name)) for name in module.__all__]


def _documented(obj: object) -> bool:
    return ">>>" in (inspect.getdoc(obj) or "")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_has_a_doctest(namespace):
    module = importlib.import_module(namespace)
    assert _documented(module), f"{namespace}: its docstring has no example"
    missing = [
        name
        for name, obj in _public(namespace)
        # Constants (names, tables) are shown by their module's example; modules by their own.
        if (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)) and not _documented(obj)
    ]
    assert missing == []


def test_the_check_sees_a_missing_example():
    def bare():
        """No example."""

    assert not _documented(bare)
