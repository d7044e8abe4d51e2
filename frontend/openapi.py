"""OpenAPI request-body schemas for routes that parse their own bodies.

Handlers read raw bytes and parse them once with orjson (FastAPI's own body parsing would run the stdlib json over
500 KB prompts), so FastAPI cannot infer their schemas. This puts the wire models' JSON schemas into the OpenAPI
document by hand, so that clients, docs and schema-driven fuzzers (schemathesis) see the real contract.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    }


def install_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add ``models`` (and the models they use) to the app's OpenAPI components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # noqa: B010 - FastAPI's documented way to customise the schema


