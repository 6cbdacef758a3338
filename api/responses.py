"""The read routes' JSON: a response model serialized once, on the endpoint's own thread.

Returned as a model, FastAPI would validate a sync endpoint's value again and serialize it
in a second hand-off to a worker thread: that doubled the CPU time of ``GET /jobs/{id}``,
the route dashboards and CLIs poll. A read route declares its ``response_model`` (the
OpenAPI schema is unchanged) and returns ``ModelJSON(model)``.
"""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import Response


class ModelJSON(Response):
    media_type = "application/json"

    def __init__(self, model: BaseModel) -> None:
        super().__init__(model.model_dump_json())
