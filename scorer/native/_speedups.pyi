from array import array
from collections.abc import Callable, Sequence
from typing import Any

def chain_keys(tokens: Sequence[int], block_size: int, seed: int) -> list[int]: ...
def chain_keys_bytes(data: bytes | bytearray | memoryview, stride: int, seed: int) -> list[int]: ...
def msgpack_uint32s(raw: object) -> array[int] | None: ...
def engine_keys(hashes: list[object]) -> list[int] | None: ...

class EngineMap:
    def __len__(self) -> int: ...
    def __contains__(self, k: object) -> bool: ...
    def get(self, k: int, default: int | None = None) -> int | None: ...
    def __getitem__(self, k: int) -> int: ...
    def __setitem__(self, k: int, v: int) -> None: ...
    def __delitem__(self, k: int) -> None: ...
    def update_pairs(self, ekeys: Sequence[int], keys: Sequence[int]) -> list[int]: ...
    def pop_oldest(self, n: int) -> list[tuple[int, int]]: ...
    def clear(self) -> None: ...
    def items(self) -> list[tuple[int, int]]: ...
    def keys(self) -> list[int]: ...
    def values(self) -> list[int]: ...
    def nbytes(self) -> int: ...

def msgpack_uint64s(raw: object) -> array[int] | None: ...
def stored_chain(
    tokens: array[int],
    hashes: array[int],
    n: int,
    block_size: int,
    seed: int,
    keys_out: array[int],
    ekeys_out: array[int],
) -> bool: ...
def index_add(
    d: dict[int, int], emap: EngineMap, ekeys: array[int], keys: array[int], bit: int
) -> tuple[int, list[tuple[int, int]], list[int]]: ...
def decode_batch(
    payload: bytes,
    stored_cls: type[Any],
    removed_cls: type[Any],
    cleared_cls: type[Any],
    normalize: Callable[[object], str],
) -> tuple[float, list[Any], int | None] | None: ...
def stored_events(
    events: list[Any],
    i: int,
    stored_cls: type[Any],
    medium: str,
    block_size: int,
    emap: object,
    keys_out: array[int],
    ekeys_out: array[int],
) -> tuple[int, int]: ...
def load_columns(
    candidates: Sequence[Any],
    fresh_since: float,
    wrb: float,
    busy_w: float | None,
    busy_k: float | None,
    busy_i: int | None,
    check: bool,
) -> tuple[list[float], list[float], list[float], list[float], list[str | None] | None]: ...
def decay_credit(pf: list[float], dc: list[float], rb: float, decay: float) -> list[float]: ...
def cost_column(
    pf: list[float],
    dc: list[float],
    credit: list[float],
    weighted: list[float],
    held: list[float],
    rb: float,
    pls: float,
    dup: float,
    best: float,
) -> list[float]: ...
def cost_core(
    cands: list[Any],
    eps: list[str],
    pf: list[float],
    dc: list[float],
    matches: dict[str, Any] | None,
    rb: float,
    decay: float,
    stale: Callable[[Any], bool] | None,
    sc: float,
    dup_opt: float,
    new_session: bool,
    pls: float,
    waiting: list[float] | None,
    cap: float,
    add_share: bool,
    step_share: float,
) -> tuple[
    list[Any],
    bool,
    list[float],
    list[bool] | None,
    bool,
    list[float],
    float,
    list[float],
    float,
    list[float],
    list[float] | None,
]: ...
def pick_lowest(
    costs: list[float],
    tiebreak: Callable[[int], tuple[float, ...]],
    rng: Any,
    random_type: type,
) -> int: ...
def ids_u32_bytes(ids: list[int]) -> bytes: ...
def json_ids_u32(buf: bytes, pos: int) -> tuple[bytes, int, int] | None: ...
def gpu_depths(
    keys: Sequence[int],
    gpu: dict[int, int],
    spec: dict[int, int],
    cpu: dict[int, int],
    disk: dict[int, int],
    allowed: int,
) -> dict[int, int] | None: ...
def append_stages(
    stages: dict[str, float], pending: dict[str, list[float]], fold_at: int
) -> bool: ...
def media_depths(
    keys: Sequence[int],
    gpu: dict[int, int],
    spec: dict[int, int],
    cpu: dict[int, int],
    disk: dict[int, int],
    allowed: int,
) -> tuple[dict[int, int], dict[int, int], dict[int, int]]: ...
def depth_matches(
    counts: dict[int, int], bit_ep: list[str], cache: dict[int, Any], make: Callable[[int], Any]
) -> dict[str, Any]: ...
def chunk_lane(
    conn: Any, s: Any, data: bytes, start: int, end: int, lane: tuple[Any, ...]
) -> bool: ...
def queue_lane(conn: Any, s: Any, data: bytes, start: int, end: int) -> bool: ...
def frame_lane(conn: Any, data: bytes) -> bool: ...
def write_lane(s: Any, data: bytes) -> bool: ...
def take_lane(s: Any) -> Any: ...

LANE_CONSTANTS: tuple[int, int, int, int, int]
