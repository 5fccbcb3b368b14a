"""`APIFuture`: the result of a request, awaitable from async code and blockable from sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from typing import Any, Generic, TypeVar

from bios import exceptions

T = TypeVar("T")


class APIFuture(Generic[T]):
    """Resolves when the request has run. `accepted` resolves earlier: when the coordinator has it in order."""

    def __init__(
        self,
        result: concurrent.futures.Future[T],
        accepted: concurrent.futures.Future[Any] | None = None,
        request_id: str | None = None,
    ) -> None:
        self._result = result
        self._accepted = accepted
        self.request_id = request_id

    def result(self, timeout: float | None = None) -> T:
        try:
            return self._result.result(timeout)
        except concurrent.futures.TimeoutError:
            raise exceptions.TimeoutError(
                f"request {self.request_id or ''} did not finish within {timeout}s; it is still queued or running, "
                "call result() again to keep waiting",
                request_id=self.request_id,
            ) from None

    async def result_async(self, timeout: float | None = None) -> T:
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._result)), timeout)
        except asyncio.TimeoutError:
            raise exceptions.TimeoutError(
                f"request {self.request_id or ''} did not finish within {timeout}s", request_id=self.request_id
            ) from None

    async def accepted_async(self) -> None:
        """Wait until the coordinator has validated, stored and ordered the request (the first await)."""
        if self._accepted is not None:
            await asyncio.wrap_future(self._accepted)

    def done(self) -> bool:
        return self._result.done()

    def future(self) -> concurrent.futures.Future[T]:
        return self._result

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<APIFuture {self.request_id or ''} {state}>"
