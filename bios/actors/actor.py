"""Local actors: a mailbox of method calls run one at a time, `tell`/`ask`, and supervision.

As with Ray's actors, a caller names the method and its arguments (`ref.ask(Scheduler.schedule, group_id)`),
so an IDE follows the call to its handler. The calls run one at a time on the actor's task, so its state needs
no locks. A handler exception goes back to the asker (if any); the actor is then resumed, restarted from its
factory, or stopped according to its policy, and its supervisor callback is told.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class Actor:
    """Subclass and give it methods (plain or async); a method's return value answers an `ask`."""

    async def started(self) -> None:
        """Called once before the first call (and again after a restart)."""

    async def stopped(self) -> None:
        """Called when the actor stops or before it is restarted."""


class Policy(enum.Enum):
    RESUME = "resume"  # keep the actor and its state; the failed message is answered with the error
    RESTART = "restart"  # build a fresh actor from its factory
    STOP = "stop"  # stop; later asks fail with ActorStopped


class ActorStopped(RuntimeError):
    """The actor is no longer running."""


@dataclass(frozen=True)
class Failure:
    """What a supervisor is told when one of its actors fails."""

    actor: str
    error: BaseException
    action: Policy


@dataclass(frozen=True)
class _Call:
    """One mailbox entry: a method of the actor's class and its arguments."""

    method: Callable[..., Any]
    args: tuple[Any, ...]

    @property
    def name(self) -> str:
        return getattr(self.method, "__qualname__", repr(self.method))


_STOP = _Call(lambda _actor: None, ())


class ActorRef:
    """The handle other code holds: `tell` (fire and forget) and `ask` (await the reply), each with a method of
    the actor's class and its arguments."""

    def __init__(
        self,
        factory: Callable[[], Actor],
        *,
        name: str,
        policy: Policy = Policy.RESUME,
        on_failure: Callable[[Failure], None] | None = None,
    ) -> None:
        self.name = name
        self._factory = factory
        self._policy = policy
        self._on_failure = on_failure
        self._mailbox: asyncio.Queue[tuple[_Call, asyncio.Future[Any] | None]] = asyncio.Queue()
        self._actor = factory()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._stopping = False

    @property
    def actor(self) -> Actor:
        return self._actor

    @property
    def running(self) -> bool:
        return self._task is not None and not self._stopped and not self._stopping

    def start(self) -> ActorRef:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"actor:{self.name}")
        return self

    def tell(self, method: Callable[..., Any], *args: Any) -> None:
        """Call `method(actor, *args)` in turn, without waiting for it."""
        if self._stopped:
            raise ActorStopped(f"actor {self.name} is stopped")
        self._mailbox.put_nowait((_Call(method, args), None))

    def ask_future(self, method: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Enqueue the call now (so mailbox order is call order) and return the future of its result."""
        if self._stopped:
            raise ActorStopped(f"actor {self.name} is stopped")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._mailbox.put_nowait((_Call(method, args), future))
        return future

    async def ask(self, method: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Call `method(actor, *args)` in turn and return its result (or raise its error)."""
        future = self.ask_future(method, *args)
        if timeout is None:
            return await future
        return await asyncio.wait_for(future, timeout)

    async def stop(self) -> None:
        """Process what is already queued, then stop."""
        self._stopping = True
        if self._task is None or self._stopped:
            self._stopped = True
            return
        self._mailbox.put_nowait((_STOP, None))
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        try:
            await self._actor.started()
            while True:
                call, future = await self._mailbox.get()
                if call is _STOP:
                    break
                try:
                    result = call.method(self._actor, *call.args)
                    if inspect.isawaitable(result):
                        result = await result
                except asyncio.CancelledError:
                    if future is not None and not future.done():
                        future.cancel()
                    raise
                except Exception as exc:
                    if future is not None and not future.done():
                        future.set_exception(exc)
                    if not await self._handle_failure(exc, call):
                        break
                else:
                    if future is not None and not future.done():
                        future.set_result(result)
            self._stopped = True
            await self._actor.stopped()
        except Exception as exc:  # started()/stopped() failed, e.g. on a restart: the actor cannot go on
            log.error("actor %s stopped: its lifecycle failed: %r", self.name, exc, exc_info=exc)
            if self._on_failure is not None:
                self._on_failure(Failure(self.name, exc, Policy.STOP))
        finally:  # however the loop ends, nobody may be left waiting on this mailbox
            self._stopped = True
            self._fail_pending()

    async def _handle_failure(self, exc: Exception, call: _Call) -> bool:
        """Apply the policy; returns whether to keep running."""
        action = self._policy
        if action is not Policy.RESUME or not _is_expected(exc):
            log.error("actor %s failed in %s: %r", self.name, call.name, exc, exc_info=exc)
        if self._on_failure is not None:
            self._on_failure(Failure(self.name, exc, action))
        if action is Policy.RESTART:
            await self._actor.stopped()
            self._actor = self._factory()
            await self._actor.started()
        return action is not Policy.STOP

    def _fail_pending(self) -> None:
        while not self._mailbox.empty():
            _, future = self._mailbox.get_nowait()
            if future is not None and not future.done():
                future.set_exception(ActorStopped(f"actor {self.name} stopped"))


def _is_expected(exc: Exception) -> bool:
    """Errors that answer a bad request are the asker's business, not a crash worth a traceback."""
    return getattr(exc, "category", None) == "user"


def spawn(
    factory: Callable[[], Actor],
    *,
    name: str,
    policy: Policy = Policy.RESUME,
    on_failure: Callable[[Failure], None] | None = None,
) -> ActorRef:
    """Create and start an actor on the running loop."""
    return ActorRef(factory, name=name, policy=policy, on_failure=on_failure).start()
