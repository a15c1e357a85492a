"""Which backend serves a CUDA attention call: the measured routing table.

The dispatcher (:mod:`litctx_kernels.dispatch`) describes each softmax attention call on a CUDA device by its
*kind* and *shape*, and this module picks the backend from candidates that can serve it:

================  ================================================  =============================================
kind              the call                                          candidates (default first)
================  ================================================  =============================================
``dense``         no causal mask (or every key visible), > 16 rows  sdpa_flash, sdpa_efficient, sdpa_cudnn, triton
``decode``        the same with at most 16 query rows               as ``dense``
``causal``        causal, queries = keys, ``q_offset = 0``          as ``dense``
``key_mask``      dense or causal (as above) with a ``key_mask``    sdpa_efficient, triton
``block_sparse``  a block layout that skips blocks                  triton, flex, triton_tile
================  ================================================  =============================================

``triton_tile`` is K1's forward at its tuned tile over a layout with smaller blocks (SALE's 64 x 32 at 128 x 64):
the coarsened layout's tiles with the fine blocks masked per element (``triton_attention(tile=...)``), eligible
for forward calls whose layout blocks divide the tuned tile (``CallShape.fine_layout``). Block-sparse rows
carry the layout's block shape (``block``), so a table can send SALE's layouts one way and Prism's another.

Everything else (windows, a ``q_offset`` inside the sequence, query subsets, LSSA/LSSAR, column statistics)
has one CUDA backend, Triton, and never consults the table.

The table (:data:`SHIPPED_TABLE`, ``litctx_kernels/routing_table.json``; ``$LITCTX_ROUTING_TABLE`` names
another) is written by ``python -m bench.gpu_routing`` on a GPU: one row per (device, kind, dtype, head dim,
length range) with the measured milliseconds of every candidate and the fastest. A row matches a call when
the device name, the kind, the dtype and whether a backward is needed are equal, the head dim is equal (or
the row's is null) and the length (keys) lies in ``[n_min, n_max]``. The first matching row whose winner can
serve the call decides; without one, the safe default holds: PyTorch's SDPA for dense, causal and key-masked
calls (FlashAttention for fp16/bf16 without a mask, memory-efficient otherwise) and Triton K1 for block
layouts. Nothing here touches a device: tests route with a mocked device name.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["DECODE_ROWS", "CallShape", "Route", "RoutingRow", "RoutingTable", "ROUTED_KINDS", "CANDIDATES",
           "SHIPPED_TABLE", "TABLE_ENV", "default_backend", "eligible_backends", "load_table", "route"]

TABLE_ENV = "LITCTX_ROUTING_TABLE"
SHIPPED_TABLE = Path(__file__).with_name("routing_table.json")

ROUTED_KINDS = ("dense", "decode", "causal", "key_mask", "block_sparse")
DECODE_ROWS = 16
"""Calls with every key visible and at most this many query rows are ``decode`` calls (their own table rows)."""
CANDIDATES: Dict[str, Tuple[str, ...]] = {
    "dense": ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "triton"),
    "decode": ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "triton"),
    "causal": ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "triton"),
    "key_mask": ("sdpa_efficient", "triton"),
    "block_sparse": ("triton", "flex", "triton_tile"),
}
SDPA_BACKENDS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class CallShape:
    """What routing needs to know about one call (no tensors).

    Attributes:
        kind: one of :data:`ROUTED_KINDS`.
        dtype: ``float16`` / ``bfloat16`` / ``float32`` (``str(dtype)`` without ``torch.``).
        n_q, n_k: query and key lengths.
        head_dim, head_dim_v: ``d`` of q/k and of v.
        gqa: query heads per kv head (1 = MHA).
        triton: whether Triton can serve the call (installed, and the call is one its kernels take).
        grad: whether the call needs a backward (q, k or v requires grad under autograd).
        block: a ``block_sparse`` call's layout blocks ``(block_q, block_k)``; ``(0, 0)`` for other kinds.
        fine_layout: the layout's blocks are smaller than K1's tuned forward tile and divide it (the
            ``triton_tile`` candidate can serve the call).
    """

    kind: str
    dtype: str
    n_q: int
    n_k: int
    head_dim: int
    head_dim_v: int
    gqa: int = 1
    triton: bool = True
    grad: bool = False
    block: Tuple[int, int] = (0, 0)
    fine_layout: bool = False


@dataclass(frozen=True)
class RoutingRow:
    """One measured row of the table: on ``device``, calls of ``kind`` in ``dtype`` with ``head_dim`` and
    ``n_min <= N_k <= n_max`` that need a backward (``grad``) or not go to ``backend``; ``block`` (block-sparse
    rows; None = any) the layout's ``[block_q, block_k]``; ``ms`` keeps every candidate's measured time (forward,
    or forward + backward when ``grad``; None = failed or unsupported), ``shape`` the measured case (B, Hq, Hk, N,
    density for layouts)."""

    device: str
    kind: str
    dtype: str
    backend: str
    n_min: int = 1
    n_max: int = 1 << 62
    head_dim: Optional[int] = None
    grad: bool = False
    block: Optional[Tuple[int, int]] = None
    ms: Dict[str, Optional[float]] = field(default_factory=dict)
    shape: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"routing row {self.device!r}/{self.kind}/{self.dtype}"
        if self.kind not in ROUTED_KINDS:
            raise ValueError(f"{where}: kind must be one of {', '.join(ROUTED_KINDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype must be one of {', '.join(DTYPES)}")
        if self.backend not in CANDIDATES[self.kind]:
            raise ValueError(f"{where}: backend {self.backend!r} cannot serve {self.kind} calls; valid: "
                             f"{', '.join(CANDIDATES[self.kind])}")
        if not (isinstance(self.n_min, int) and isinstance(self.n_max, int) and 1 <= self.n_min <= self.n_max):
            raise ValueError(f"{where}: need integers 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.block is not None:
            blk = self.block
            if not (isinstance(blk, (list, tuple)) and len(blk) == 2
                    and all(isinstance(x, int) and x > 0 for x in blk)):
                raise ValueError(f"{where}: block must be null or [block_q, block_k] (positive integers), got {blk!r}")
            object.__setattr__(self, "block", (int(blk[0]), int(blk[1])))

    def matches(self, device: str, call: CallShape) -> bool:
        return (self.device == device and self.kind == call.kind and self.dtype == call.dtype
                and (self.head_dim is None or self.head_dim == call.head_dim) and self.grad == call.grad
                and (self.block is None or self.block == tuple(call.block))
                and self.n_min <= call.n_k <= self.n_max)

    def describe(self) -> str:
        timed = ", ".join(f"{k} {v:.3g} ms" for k, v in self.ms.items() if v is not None)
        return (f"table row {self.device} {self.kind} {self.dtype} d={self.head_dim} N {self.n_min}-{self.n_max}"
                + (f" blocks {self.block[0]}x{self.block[1]}" if self.block else "")
                + f"{' forward+backward' if self.grad else ' forward'}"
                + (f": {timed}" if timed else ""))


@dataclass(frozen=True)
class RoutingTable:
    """The rows (first match wins) and where they came from."""

    rows: Tuple[RoutingRow, ...] = ()
    source: str = "empty"

    def lookup(self, device: str, call: CallShape) -> Optional[RoutingRow]:
        for row in self.rows:
            if row.matches(device, call):
                return row
        return None

    def to_json(self) -> Dict[str, object]:
        return {"format": 1, "source": self.source, "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_json(cls, data: Dict[str, object], where: str = "routing table") -> "RoutingTable":
        if not isinstance(data, dict) or data.get("format") != 1 or not isinstance(data.get("rows"), list):
            raise ValueError(f"{where}: expected {{'format': 1, 'source': ..., 'rows': [...]}}")
        rows = []
        allowed = set(RoutingRow.__dataclass_fields__)
        for i, raw in enumerate(data["rows"]):
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: rows[{i}] must be a mapping, got {type(raw).__name__}")
            unknown = sorted(set(raw) - allowed)
            if unknown:
                raise ValueError(f"{where}: rows[{i}] has unknown keys {unknown}; valid: {sorted(allowed)}")
            try:
                rows.append(RoutingRow(**raw))
            except TypeError as exc:
                raise ValueError(f"{where}: rows[{i}]: {exc}") from None
            except ValueError as exc:
                raise ValueError(f"{where}: rows[{i}]: {exc}") from None
        return cls(tuple(rows), str(data.get("source", where)))


_TABLES: Dict[str, RoutingTable] = {}


def load_table(path: Optional[os.PathLike] = None) -> RoutingTable:
    """The table at ``path``, else ``$LITCTX_ROUTING_TABLE``, else the shipped one (read once per path). A
    missing shipped table is an empty table; a file named explicitly must exist and parse."""
    explicit = path if path is not None else os.environ.get(TABLE_ENV) or None
    target = Path(explicit) if explicit else SHIPPED_TABLE
    key = str(target)  # every routed call asks: no filesystem call once the table is read
    if key not in _TABLES:
        if not target.is_file():
            if explicit:
                raise FileNotFoundError(f"routing table {target} ({TABLE_ENV} or the path given) does not exist")
            _TABLES[key] = RoutingTable(source=f"{target} (absent)")
        else:
            try:
                data = json.loads(target.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"routing table {target}: not JSON ({exc})") from None
            _TABLES[key] = RoutingTable.from_json(data, str(target))
    return _TABLES[key]


def eligible_backends(call: CallShape) -> List[str]:
    """The candidates of ``call.kind`` that can serve this call (in preference order for the default).

    PyTorch's CUDA SDPA ops need ``d == dv``, ``d % 8 == 0`` and ``d <= 256``; FlashAttention and cuDNN take
    fp16/bf16 without a mask (cuDNN forward only: its backward op is not wired here); the memory-efficient
    kernel takes fp32 too and an additive mask. Causal SDPA calls
    need ``Nq == Nk`` (its causal mask is top-left aligned; the dispatcher only gives it aligned calls). Triton
    needs ``call.triton``; FlexAttention needs Triton as well (it compiles to Triton on CUDA); ``triton_tile``
    needs a forward call with ``call.fine_layout``."""
    sdpa_shape = call.head_dim == call.head_dim_v and call.head_dim % 8 == 0 and call.head_dim <= 256
    half = call.dtype in ("float16", "bfloat16")
    out = []
    for backend in CANDIDATES[call.kind]:
        if backend in ("sdpa_flash", "sdpa_cudnn") and not (sdpa_shape and half):
            continue
        if backend == "sdpa_cudnn" and call.grad:
            continue
        if backend == "sdpa_efficient" and not sdpa_shape:
            continue
        if backend in ("triton", "flex", "triton_tile") and not call.triton:
            continue
        if backend == "triton_tile" and (call.grad or not call.fine_layout):
            continue
        out.append(backend)
    return out


def default_backend(call: CallShape) -> Optional[str]:
    """The safe default: the first eligible candidate (SDPA for dense/causal/key-masked, K1 for layouts)."""
    ok = eligible_backends(call)
    return ok[0] if ok else None


@dataclass(frozen=True)
class Route:
    """A routing decision: ``backend`` (None: no candidate serves the call) and why."""

    backend: Optional[str]
    reason: str


def route(device: str, call: CallShape, table: Optional[RoutingTable] = None,
          exclude: Sequence[str] = ()) -> Route:
    """The backend for ``call`` on the CUDA device named ``device``: the table's row, else the default.
    ``exclude`` removes backends that failed at run time in this process."""
    if call.kind not in ROUTED_KINDS:
        raise ValueError(f"call kind {call.kind!r} is not routed; routed kinds: {', '.join(ROUTED_KINDS)}")
    table = load_table() if table is None else table
    ok = [b for b in eligible_backends(call) if b not in exclude]
    row = table.lookup(device, call)
    if row is not None and row.backend in ok:
        return Route(row.backend, f"measured: {row.describe()}")
    if not ok:
        return Route(None, f"no backend serves this {call.kind} call (d={call.head_dim}, dv={call.head_dim_v}, "
                           f"{call.dtype}, triton={'yes' if call.triton else 'no'})")
    why = "no table row" if row is None else f"table's {row.backend} cannot serve this call"
    return Route(ok[0], f"default for {call.kind} calls ({why}; {table.source})")
