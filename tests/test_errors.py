"""One error table: every exception kvseal raises is in the hierarchy, maps to a row of kvseal.errors.STATUSES,
and comes back to a client as the same class; no adapter or caller compares status names (ast)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import warnings
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvseal
from kvseal import errors
from kvseal.errors import STATUSES, KvsealError, error_for_code, error_for_status, translate
from kvseal.wire import lane

KVSEAL = Path(kvseal.__file__).parent
OPTIONAL = ("kvseal.copy.cuda", "kvseal.bench.cuda")  # need torch with CUDA to import fully


def _modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages([str(KVSEAL)], "kvseal.")]
    return [n for n in names if "_pb2" not in n and not n.endswith("__main__")]  # __main__ runs the CLI


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for name in _modules():
        try:
            with warnings.catch_warnings():  # vLLM's and torch's import-time deprecation warnings
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError:
            assert name in OPTIONAL, f"{name} does not import"
            continue
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


def test_every_exception_kvseal_defines_is_in_the_hierarchy_with_a_status_of_the_table() -> None:
    classes = _exception_classes()
    assert len(classes) > 15  # the walk found them
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, KvsealError)]
    assert outside == []
    assert all(c.status in STATUSES for c in classes if issubclass(c, KvsealError))


def test_the_table_is_grpc_s_and_the_lane_s() -> None:
    for name, status in STATUSES.items():
        assert grpc.StatusCode[name].value[0] == status.code
        assert lane.STATUS_CODES[name] == status.code and lane.STATUS_NAMES[status.code] == name
    assert {c.name for c in grpc.StatusCode} == set(STATUSES)


# one class per status: the direct subclasses of KvsealError (a subclass of one of them, e.g. ConfigError, comes back
# as its status's class)
CLASSES = [c for c in vars(errors).values() if isinstance(c, type) and c.__bases__ == (KvsealError,)]


@pytest.mark.parametrize("cls", CLASSES)
def test_a_client_gets_back_the_class_the_server_raised(cls: type[KvsealError]) -> None:
    if cls is KvsealError:
        return
    sent = cls("the field x is wrong")
    status, message = translate(sent, "unused")
    for back in (error_for_status(status.name, message), error_for_code(status.code, message)):
        assert type(back) is cls and str(back) == "the field x is wrong"
        assert back.http_status == status.http


@given(st.text(max_size=5000))
def test_a_bug_answers_internal_with_a_bounded_message(text: str) -> None:
    status, message = translate(RuntimeError(text), "Query failed inside the engine")
    assert status.name == "INTERNAL" and message.startswith("Query failed inside the engine: RuntimeError: ")
    assert len(message) <= errors.MAX_MESSAGE_CHARS + 1
    status, message = translate(errors.InvalidArgument(text), "unused")
    assert status.name == "INVALID_ARGUMENT" and len(message) <= errors.MAX_MESSAGE_CHARS + 1


def test_an_unknown_status_is_still_an_error_naming_it() -> None:
    e = error_for_code(99, "?")
    assert type(e) is KvsealError and "INTERNAL" in str(e)
    assert "OUT_OF_RANGE" in str(error_for_status("OUT_OF_RANGE", "x"))


def test_no_code_compares_status_names() -> None:
    """Callers catch classes: a comparison against a status name ("NOT_FOUND") or a grpc.StatusCode member is the
    table being read around."""
    found = []
    for path in KVSEAL.rglob("*.py"):
        if path.name == "errors.py" or "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                for leaf in ast.walk(side):
                    named = isinstance(leaf, ast.Constant) and leaf.value in STATUSES and leaf.value != "OK"
                    member = isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Attribute)
                    member = member and leaf.value.attr == "StatusCode"  # type: ignore[union-attr]
                    if named or member:
                        found.append(f"{path.relative_to(KVSEAL.parent)}:{node.lineno}")
    assert found == []
