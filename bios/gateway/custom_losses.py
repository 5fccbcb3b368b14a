"""Server-side custom losses for the tinker SDK: `create_custom_loss` uploads a traced loss once per session and
`forward_backward(loss_fn="custom", {"loss_id"})` names it.

The graph is checked when it arrives (`bios.custom_loss`: every node against the allow-list, a BadRequestError
naming the operation otherwise) and kept per key in the coordinator's SQLite file, so a loss_id the SDK holds
still names its loss after a restart; each forward_backward that names it carries the graph to the coordinator,
which checks it again at acceptance.
"""

from __future__ import annotations

import json
from typing import Any

from bios import types as t
from bios.custom_loss import check_custom_loss
from bios.exceptions import BadRequestError, NotFoundError

from .json_body import Body


SCHEMA = """
CREATE TABLE IF NOT EXISTS custom_losses (
    owner TEXT NOT NULL,
    loss_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (owner, loss_id)
);
"""


class CustomLosses:
    def __init__(self, db: Any) -> None:
        """`db`: the coordinator store's SQLite connection (the uploaded bodies are kept there, as sent)."""
        self.db = db
        self.db.executescript(SCHEMA)
        self._losses: dict[tuple[str, str], t.CustomLoss] = {}  # (owner, loss_id) -> the checked graph

    def create(self, owner: str, body: Body) -> str:
        """Check and keep the loss of a create_custom_loss body; returns its loss_id."""
        loss = _parse(body)
        loss_id = f"{body.text('session_id')}:loss:{body.integer('custom_loss_seq_id')}"
        self.db.execute("INSERT OR REPLACE INTO custom_losses VALUES (?, ?, ?)", (owner, loss_id, json.dumps(body.data)))
        self._losses[(owner, loss_id)] = loss
        return loss_id

    def get(self, owner: str, loss_id: str | None) -> t.CustomLoss:
        if not loss_id:
            raise BadRequestError('loss_fn "custom" needs loss_fn_config {"loss_id": ...} from create_custom_loss',
                                  field="loss_fn_config.loss_id")
        loss = self._losses.get((owner, loss_id))
        if loss is None:
            row = self.db.execute("SELECT body FROM custom_losses WHERE owner = ? AND loss_id = ?",
                                  (owner, loss_id)).fetchone()
            if row is None:
                raise NotFoundError(f"no custom loss {loss_id!r} was created with this key: create it with "
                                    "ServiceClient.create_custom_loss", field="loss_fn_config.loss_id")
            loss = self._losses[(owner, loss_id)] = _parse(Body(json.loads(row[0])))
        return loss


def _parse(body: Body) -> t.CustomLoss:
    """The checked loss of a create_custom_loss body (BadRequestError naming what is wrong)."""
    graph = body.child("graph")
    if graph.integer("format", 1) != 1:
        raise BadRequestError(f"custom loss graph format {graph.data['format']!r} is not supported (Bios reads "
                              "format 1)", field="graph.format")
    loss = t.CustomLoss(
        name=body.text("name"),
        inputs=[_input(i, f"inputs[{k}]") for k, i in enumerate(_list(body.data, "inputs"))],
        nodes=[_node(n, f"graph.nodes[{k}]") for k, n in enumerate(_list(graph.data, "nodes"))],
    )
    check_custom_loss(loss)
    return loss


def _list(data: dict[str, Any], name: str) -> list[Any]:
    value = data.get(name)
    if not isinstance(value, list):
        raise BadRequestError(f"{name} must be a list", field=name)
    return value


def _input(raw: Any, where: str) -> t.CustomLossInput:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("rank"), int):
        raise BadRequestError(f"{where} must be {{name: str, rank: 0, 1 or 2}}", field=where)
    return t.CustomLossInput(raw["name"], raw["rank"])


def _node(raw: Any, where: str) -> t.CustomLossNode:
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) for k in ("op", "name", "target")):
        raise BadRequestError(f"{where} must have string op, name and target", field=where)
    return t.CustomLossNode(raw["op"], raw["name"], raw["target"], list(raw.get("args") or []),
                            dict(raw.get("kwargs") or {}))
