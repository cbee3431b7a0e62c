"""Weights in our naming, read one tensor at a time: a lazy mapping over safetensors files.

A checkpoint is never held whole in host memory. `SafetensorsWeights` maps each of our tensor
names (see `compute_service.weights.source`) to a tensor inside a safetensors file and reads it only
when asked, through safetensors' lazy `safe_open` (framework "pt"): the file is memory-mapped and
a tensor is a view of its bytes, so reading one costs page cache, not anonymous memory, until it
is copied. `WeightSource.fetch` copies one or more tensors (concatenated along dim 0, e.g. the
fused Q/K/V projection) into one tensor of the target dtype and device in a single conversion
each, so the model is built tensor by tensor and the float32 dict of every weight never exists
(peak host memory: the final weights plus the largest fused projection, staged in one scratch
buffer while oneDNN packs it; see `compute_service.model.llama`).
The same interface wraps an in-memory dict (`TensorDict`), for tests and the uncached GGUF path.

Each read calls the source's `hooks` with (name, bytes as stored): the load progress bar
(`compute_service.weights.load_progress`) and memory measurements hang there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

#: safetensors dtype strings -> torch dtypes (the ones checkpoints of our architectures use).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip

#: Called after each tensor is read: (our name, its size as stored in bytes).
ReadHook = Callable[[str, int], None]


class WeightSource(Mapping[str, torch.Tensor]):
    """Our tensor name -> tensor, read on demand; subclasses give `_shapes`, `_dtypes` and `_view`.

    `source[name]` is a CPU tensor in the stored dtype; `fetch` is the bounded-memory read the
    model uses.
    """

    def __init__(self) -> None:
        #: Called after each tensor is read (see `ReadHook`).
        self.hooks: list[ReadHook] = []
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def _view(self, name: str) -> torch.Tensor:
        """The stored tensor, without a copy where the storage allows (a view of a mapped file)."""
        raise NotImplementedError

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self.fetch([name], "cpu", self._dtypes[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of `name` (no data read)."""
        return self._dtypes[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` without reading it. Raises KeyError when absent."""
        return self._shapes[name]

    def stored_nbytes(self, name: str | None = None) -> int:
        """Bytes of tensor `name` as stored (every tensor's when None)."""
        names = self._shapes if name is None else [name]
        return sum(_numel(self._shapes[n]) * self._dtypes[n].itemsize for n in names)

    def fetch(
        self,
        names: Sequence[str],
        device: str | torch.device,
        dtype: torch.dtype,
        zero_rows: Sequence[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensors `names` concatenated along dim 0, as one new tensor on `device` in `dtype`.

        Each tensor is converted once, straight into its rows of the result (no intermediate
        copy in host memory when the stored tensor is a file view). With `zero_rows` (1-D
        tensors), an absent name `names[i]` gives `zero_rows[i]` zeros (a fused bias whose
        checkpoint lacks one member). With `out` (e.g. a view of a scratch buffer reused for
        every projection that is packed), the result is written there: no allocation.

        Raises:
            KeyError: a name is absent (and no `zero_rows`).
            ValueError: a tensor is not floating point (an integer or bool tensor is no weight),
                the tensors' trailing dimensions differ, or `out` has another shape.
        """
        bad = [f"{n} ({self._dtypes[n]})" for n in names if n in self._dtypes and not self._dtypes[n].is_floating_point]
        if bad:
            raise ValueError(f"weights must be floating point; {', '.join(bad)} are not")
        shapes = []
        for i, n in enumerate(names):
            if n in self._shapes:
                shapes.append(self._shapes[n])
            elif zero_rows is not None:
                shapes.append((zero_rows[i],))
            else:
                raise KeyError(f"weight {n!r} missing")
        rest = shapes[0][1:]
        if any(s[1:] != rest for s in shapes):
            raise ValueError(f"cannot concatenate {list(names)} along dim 0: shapes {shapes}")
        shape = (sum(s[0] for s in shapes), *rest)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
        elif tuple(out.shape) != shape:
            raise ValueError(f"out has shape {list(out.shape)}, {list(names)} need {list(shape)}")
        row = 0
        for n, s in zip(names, shapes):
            part = out[row : row + s[0]]
            if n in self._shapes:
                view = self._view(n)
                part.copy_(view)
                del view
                for hook in self.hooks:
                    hook(n, self.stored_nbytes(n))
            else:
                part.zero_()
            row += s[0]
        return out

    def close(self) -> None:
        """Release open files (nothing to release in memory). Reads after this reopen them."""


class TensorDict(WeightSource):
    """A `WeightSource` over tensors already in memory (`weights[name]` is the tensor itself)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._tensors = dict(tensors)
        self._shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        self._dtypes = {k: v.dtype for k, v in self._tensors.items()}

    def _view(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor lives: a safetensors file and its name inside it."""

    path: Path  # the safetensors file
    key: str  # the tensor's name in that file
    shape: tuple[int, ...]  # as stored
    dtype: torch.dtype  # as stored


class SafetensorsWeights(WeightSource):
    """A `WeightSource` over safetensors files, each tensor read when asked (`safe_open`, "pt").

    Args:
        tensors: our name -> where it is stored (see `index_safetensors`).

    Files are opened on first use and stay mapped until `close()` (mapped pages are page cache,
    shared and reclaimable; only the copies `fetch` makes are anonymous memory).
    """

    def __init__(self, tensors: Mapping[str, StoredTensor]) -> None:
        super().__init__()
        self.tensors = dict(tensors)
        self._shapes = {k: t.shape for k, t in self.tensors.items()}
        self._dtypes = {k: t.dtype for k, t in self.tensors.items()}
        self._files: dict[Path, object] = {}

    @classmethod
    def from_files(cls, files: Sequence[str | Path]) -> SafetensorsWeights:
        """Every tensor of `files` under its own name (a checkpoint already in our naming)."""
        return cls({k: t for f in files for k, t in index_safetensors(f).items()})

    def _view(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        t = self.tensors[name]
        f = self._files.get(t.path)
        if f is None:
            f = self._files[t.path] = safe_open(t.path, framework="pt")
        return f.get_tensor(t.key)

    def close(self) -> None:
        self._files.clear()


def index_safetensors(path: str | Path) -> dict[str, StoredTensor]:
    """Name, shape and dtype of every tensor in a safetensors file, from its header (no data read).

    Raises:
        ValueError: a tensor of a dtype torch cannot hold, or a file safetensors cannot read (empty,
            truncated, a malformed header: its error, with the file named).
    """
    from safetensors import safe_open

    path = Path(path)
    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{path}: tensor {key} has dtype {sl.get_dtype()}, which pagedkv does not load")
                out[key] = StoredTensor(path, key, tuple(sl.get_shape()), dtype)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return out


def as_weight_source(weights: Mapping[str, torch.Tensor]) -> WeightSource:
    """`weights` itself when it is a `WeightSource`, else a `TensorDict` over it."""
    return weights if isinstance(weights, WeightSource) else TensorDict(weights)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
