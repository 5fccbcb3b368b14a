"""Why an aborted cycle's request runs again or not, and why a run is lost: the messages for `Run.cycle_aborted`.

A request is retried after one aborted cycle. Two deaths (workers killed or out of memory while running it) or
two stalls (cycles that could not complete with every worker alive, the second with the request in a cycle of
its own) end it with one of these errors, so a request can neither take down worker after worker nor hold the
cluster in a loop of aborts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runs import Queued

from bios import messages as m


def _size(op: m.Request | None) -> str:
    """", 1234 tokens in 3 rows (the longest 1000)" for a request that carries data, else ""."""
    data = getattr(op, "data", None)
    if not data:
        return ""
    lengths = [d.model_input.length for d in data]
    return f", {sum(lengths)} tokens in {len(lengths)} rows (the longest {max(lengths)})"


LOST = ("its state died with every worker that held it and it has no automatic checkpoint (start the coordinator "
        "with --checkpoint-every N); create a new run or load a saved state with create_training_client_from_state")


def killed_once(shrunk: int | None, connected: bool) -> str:
    """The notice for a request that was running when a worker died: it runs once more, in smaller passes."""
    return ("a worker died while running this request (killed, or out of memory); it runs again"
            + (f" in passes of at most {shrunk} tokens" if shrunk else "")
            + ("" if connected else " when a worker is connected"))


def killed_twice(queued: Queued, budgets: list[int]) -> str:
    """Why a request that was running when workers died in two cycles is not retried again."""
    memory = ", ".join(f"{b / 2**30:.1f} GiB" for b in budgets) or "no worker connected now"
    return (f"workers died twice while running {queued.request_id} ({type(queued.op).__name__}{_size(queued.op)}): "
            f"killed, or out of memory (the workers' memory budgets: {memory}); it is not retried again, so it cannot "
            "take down more workers: send it in smaller batches, or give the workers more memory (bios-worker "
            "--memory-limit is the budget plans count on)")


def stalled_once(why: str) -> str:
    """The notice for a request whose cycle aborted with every worker alive: it runs again, alone."""
    return (f"the cycle running this request aborted with every worker alive ({why}); it runs again in a cycle of "
            "its own")


def stalled_twice(queued: Queued, why: str) -> str:
    """Why a request whose cycles aborted twice with every worker alive, the second time alone, is given up."""
    return (f"{queued.request_id} ({type(queued.op).__name__}{_size(queued.op)}) was in two cycles that aborted with "
            f"every worker alive, the second with no other request ({why}); it is not retried again. A pass that "
            "keeps one worker busy longer than the collective timeout beyond its peers cannot complete: send shorter "
            "rows or smaller batches, or raise bios-coordinator --collective-timeout")
