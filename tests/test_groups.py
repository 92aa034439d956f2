"""KV cache groups through a real `kvseal serve`: a hybrid registration (sliding window + full attention, as
Gemma 3) seals into a format 2 layout with its own namespace_final, apart from the same layers in one group (vLLM's
hybrid manager off) and from another window; a group the engine cannot serve is refused naming the field."""

from __future__ import annotations

import json

import pytest

from kvseal.errors import FailedPrecondition, InvalidArgument
from kvseal.memfd import SharedArray
from kvseal.testing import EngineProcess, register_one_rank

LAYERS = [f"model.layers.{i}.attn" for i in range(6)]
SLIDING_EVERY_LAYER_BUT_THE_LAST = {name: 0 if i < 5 else 1 for i, name in enumerate(LAYERS)}


def _register(engine: EngineProcess, instance: str, groups: list[tuple[str, int, int]], ids: dict[str, int]) -> object:
    shared = SharedArray((len(LAYERS), 8, 4096))
    views = {name: shared.array[i] for i, name in enumerate(LAYERS)}
    client = engine.client()
    try:
        return register_one_rank(
            client,
            instance,
            shared,
            views,
            namespace="gemma",
            layout_tag="t",
            dtype="bfloat16",
            groups=groups,
            group_ids=ids,
        )
    finally:
        shared.close()


def test_hybrid_groups_seal_apart_from_one_group_and_from_another_window(engine: EngineProcess) -> None:
    on = _register(engine, "on", [("sliding", 16, 1024), ("full", 16, 0)], SLIDING_EVERY_LAYER_BUT_THE_LAST)
    off = _register(engine, "off", [], {})
    wider = _register(engine, "wider", [("sliding", 16, 4096), ("full", 16, 0)], SLIDING_EVERY_LAYER_BUT_THE_LAST)
    names = {s.namespace_final for s in (on, off, wider)}  # type: ignore[attr-defined]
    assert len(names) == 3 and all(n.startswith("gemma.") for n in names)
    descriptor = json.loads(on.descriptor)  # type: ignore[attr-defined]
    assert descriptor["format"] == 2 and descriptor["groups"] == [["sliding", 16, 1024], ["full", 16, 0]]
    assert json.loads(off.descriptor)["format"] == 1  # type: ignore[attr-defined]
    compared = engine.client().compare(on.namespace_final, wider.descriptor)  # type: ignore[attr-defined]
    assert not compared.compatible and "group 0" in compared.message and "1024" in compared.message


@pytest.mark.parametrize(
    ("groups", "error", "message"),
    [
        ([("sliding", 16, 0), ("full", 16, 0)], InvalidArgument, "groups[0].span (the window, in tokens)"),
        ([("paged", 16, 0), ("full", 16, 0)], InvalidArgument, "groups[0].kind must be one of"),
        ([("full", 16, 0)] * 65, InvalidArgument, "groups has 65"),
        ([("sliding", 16, 64), ("full", 16, 0), ("mamba", 16, 0)], FailedPrecondition, "group 2 (mamba x16) has no"),
    ],
)
def test_a_group_the_engine_cannot_serve_is_refused_naming_it(
    engine: EngineProcess, groups: list[tuple[str, int, int]], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as e:
        _register(engine, "bad", groups, SLIDING_EVERY_LAYER_BUT_THE_LAST)
    assert message in str(e.value)
