"""The dense arrays of the vocabulary: `TensorData`, a Tinker-dtyped numpy array.

Its own module because every other part of the vocabulary (training data, sampling results, prompt scores)
holds these, and it alone knows how arrays convert to and from numpy and torch (torch imported only when asked).
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import numpy as np

TensorDtype = Literal["int64", "float32"]

_NP_DTYPES: dict[str, np.dtype] = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}


class TensorData:
    """A dense array with a Tinker dtype (`int64` or `float32`), stored as numpy."""

    __slots__ = ("_array",)

    def __init__(
        self,
        data: Sequence[float] | Sequence[int] | np.ndarray | None = None,
        dtype: TensorDtype | None = None,
        shape: Sequence[int] | None = None,
    ) -> None:
        if dtype is None:
            raise TypeError("TensorData needs a dtype: 'int64' or 'float32'")
        if dtype not in _NP_DTYPES:
            raise ValueError(f"TensorData dtype must be 'int64' or 'float32', got {dtype!r}")
        array = np.asarray([] if data is None else data, dtype=_NP_DTYPES[dtype])
        if shape is not None and list(array.shape) != list(shape):
            array = array.reshape(tuple(shape))
        self._array = array

    @property
    def dtype(self) -> TensorDtype:
        return "int64" if self._array.dtype == np.int64 else "float32"

    @property
    def shape(self) -> list[int]:
        return list(self._array.shape)

    @property
    def data(self) -> list[Any]:
        return self._array.reshape(-1).tolist()

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
            return cls(array.astype(np.int64, copy=False), "int64")
        return cls(array.astype(np.float32, copy=False), "float32")

    @classmethod
    def from_torch(cls, tensor: Any) -> TensorData:
        import torch

        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            return cls(tensor.to(torch.float32).contiguous().numpy(), "float32")
        return cls(tensor.to(torch.int64).contiguous().numpy(), "int64")

    def to_numpy(self) -> np.ndarray:
        return self._array

    def to_torch(self) -> Any:
        """A tensor sharing memory when it may; arrays received read-only off the wire are copied first."""
        import torch

        array = np.ascontiguousarray(self._array)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def tolist(self) -> list[Any]:
        return self._array.tolist()

    def __len__(self) -> int:
        return int(self._array.shape[0]) if self._array.ndim else 1

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorData)
            and self.dtype == other.dtype
            and np.array_equal(self._array, other._array)
        )

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype!r}, shape={self.shape}, data={self._array!r})"
