"""A JSON object's fields read with their types checked: `Body`, the one way the gateway reads a request body.

Its own module because every JSON front end reads bodies through it: the Tinker wire (`json_wire`,
`json_types`), the OpenAI wire (`openai_request`) and custom losses. A missing or mistyped field is a
BadRequestError naming it (`where.name`).
"""

from __future__ import annotations

from typing import Any

from bios.exceptions import BadRequestError

_REQUIRED = object()


class Body:
    """A JSON object's fields, read with their types checked; errors name the field (`where.name`)."""

    def __init__(self, data: Any, where: str = "") -> None:
        if not isinstance(data, dict):
            raise BadRequestError(f"{where or 'the body'} must be a JSON object", field=where or "body")
        self.data = data
        self.where = where

    def _field(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def _get(self, name: str, types: tuple[type, ...], what: str, default: Any) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise BadRequestError(f"{self._field(name)} is required", field=self._field(name))
            return default
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise BadRequestError(f"{self._field(name)} must be {what}, got {value!r}", field=self._field(name))
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._get(name, (str,), "a string", default)

    def integer(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._get(name, (int,), "an integer", default)

    def number(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self._get(name, (int, float), "a number", default)
        if not isinstance(value, int):
            return value
        try:
            return float(value)
        except OverflowError:
            raise BadRequestError(f"{self._field(name)} is too large: {str(value)[:20]}...",
                                  field=self._field(name)) from None

    def flag(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._get(name, (bool,), "true or false", default)

    def child(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self._get(name, (dict,), "a JSON object", default)
        return Body(value, self._field(name)) if isinstance(value, dict) else value

    def array(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._get(name, (list,), "a list", default)
