"""``/api/v1/code``: upload a zip of your own model and data code, for jobs to name.

Uploading code is a permission an admin grants (``shoal token create --user NAME --code``):
the code runs on the cluster's nodes, in the job's Ray workers, never in the API.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from shoal.api.deps import CodeChecksDep, PrincipalDep, require_code_permission
from shoal.api.errors import documented
from shoal.service.code_archive import ArchiveError

router = APIRouter(prefix="/code", tags=["code"])


class CodeOut(BaseModel):
    digest: str = Field(description="name the code in a job spec with it: `code: <digest>`")
    bytes: int
    files: int
    modules: list[str] = Field(
        description="the top-level modules it provides, for `code:module:function` factories"
    )


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses=documented(401, 403, 413, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload_code(
    request: Request,
    principal: PrincipalDep,
    checks: CodeChecksDep,
) -> CodeOut:
    """Keep a zip archive of code (its files at the archive's root, as `shoal submit --code
    DIR` packs them) and return its digest. The same bytes give the same digest and are kept
    once. Nothing in it is run here: a job naming it is checked in a Ray worker."""
    require_code_permission(principal)
    data = await request.body()
    try:
        stored = await run_in_threadpool(checks.store.put, data)
    except ArchiveError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    return CodeOut(
        digest=stored.digest,
        bytes=stored.bytes,
        files=stored.contents.files,
        modules=list(stored.contents.modules),
    )
