"""hash_wire.pack_hashes against a simple model: it packs exactly the lists whose every element is a
16-byte buffer, and refuses every other list with INVALID_FIELD naming a culprit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.client.hash_wire import check_hashes, pack_hashes
from kvtier.client.protocol import HASH_BYTES, ErrorCode, ProtocolError

# Lengths around the right one, so that wrong lengths can add up to a right total (15 + 17).
_element = st.one_of(
    st.integers(HASH_BYTES - 2, HASH_BYTES + 2).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
    st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES).map(bytearray),
    st.sampled_from(["x" * HASH_BYTES, None, 7]),
)


@given(st.lists(_element, max_size=40))
def test_pack_hashes_packs_exactly_the_lists_of_16_byte_buffers(hashes: list) -> None:  # type: ignore[type-arg]
    valid = all(isinstance(h, (bytes, bytearray)) and len(h) == HASH_BYTES for h in hashes)
    if valid:
        assert pack_hashes(hashes) == b"".join(hashes)
    else:
        with pytest.raises(ProtocolError) as info:
            pack_hashes(hashes)
        assert info.value.code == ErrorCode.INVALID_FIELD
        assert "block hash" in str(info.value)


def test_lengths_that_add_up_are_still_refused() -> None:
    good = bytes(HASH_BYTES)
    for bad in ([b"\x00" * 15, b"\x00" * 17], [good, b"\x01" * 15, b"\x00" * 17, good]):
        with pytest.raises(ProtocolError, match=r"block hash \d+: must be 16-byte bytes"):
            pack_hashes(bad)
        with pytest.raises(ProtocolError):
            check_hashes(bad)
