"""protocol.encode packs a header to exactly the bytes msgpack.packb(use_bin_type=True) gives it (it packs
dicts through msgspec, which is faster), values msgspec refuses on its own included: subclasses of int,
float and str, such as numpy's scalars."""

from __future__ import annotations

import enum
from typing import Any

import msgpack
import numpy as np
import pytest
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


def test_a_request_nested_a_thousand_deep_is_refused_not_a_crash() -> None:
    """The fuzzer's deep nesting under a hash field (tests/stress/fuzzlib.py): validate_request re-encodes the
    header, and msgspec's encoder nests on the C stack to the recursion limit; a RecursionError there ended the
    daemon's loop (tests/stress/test_load.py: "the daemon does not answer stats after the load")."""
    from kvtier.client.protocol import ErrorCode, ProtocolError, decode_request

    for depth in (100, 1000, 1500):
        data = (b"\x85\xa1v\x01\xa2op\xa6lookup\xa2id\x01\xa3sid\xa2ss\xa6hashes\x91" + b"\x91" * depth + b"\x90")
        with pytest.raises(ProtocolError) as info:
            decode_request(data)
        assert info.value.code in (ErrorCode.INVALID_FIELD, ErrorCode.MALFORMED), info.value
