"""The one place that picks an engine implementation by name (as uvicorn's ``auto.py`` picks a protocol).

``ENGINES`` maps a name to the module path of the engine's factory, ``create(options: EngineOptions) -> Engine``;
the module is imported only when that engine is chosen, so the synthetic path never loads numpy-heavy model code.
A new engine is one module with a ``create`` function plus one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from workers.engines.base import Engine
from workers.engines.options import EngineOptions
from workers.engines.reference.options import reference_options

__all__ = ["ENGINES", "ENGINE_NAMES", "EngineOptions", "create_engine", "reference_options"]

ENGINES: dict[str, str] = {
    "reference": "workers.engines.reference.engine",
    "synthetic": "workers.engines.synthetic",
    "simulated": "workers.engines.simulated",
    "vllm": "workers.engines.vllm.engine",
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def create_engine(name: str, options: EngineOptions) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    create: Callable[[EngineOptions], Engine] = importlib.import_module(ENGINES[name]).create
    return create(options)
