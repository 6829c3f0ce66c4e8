"""protocol.encode packs a header to exactly the bytes msgpack.packb(use_bin_type=True) gives it (it packs
dicts through msgspec, which is faster), values msgspec refuses on its own included: subclasses of int,
float and str, such as numpy's scalars."""

from __future__ import annotations

import enum
from typing import Any

import msgpack
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvtier.client.protocol import encode


class _Code(enum.IntEnum):
    A = 7


class _Seconds(float):
    pass


class _Name(str):
    pass


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False), st.text(max_size=300),
    st.binary(max_size=300),
    st.sampled_from([np.float64(0.25), np.float32(1.5).item(), _Code.A, _Seconds(2.5), _Name("x"), True]),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)), max_leaves=20)


@given(st.dictionaries(st.text(max_size=12), _values, max_size=8))
def test_encode_gives_msgpacks_bytes(header: dict[str, Any]) -> None:
    assert encode(header) == msgpack.packb(header, use_bin_type=True)


def test_a_numpy_float_in_a_map_packs_as_a_double() -> None:
    header = {"v": 1, "ok": True, "hit_rate": np.float64(0.5), "ratio": _Seconds(1.25)}
    assert encode(header) == msgpack.packb(header, use_bin_type=True)
    assert msgpack.unpackb(encode(header)) == {"v": 1, "ok": True, "hit_rate": 0.5, "ratio": 1.25}
