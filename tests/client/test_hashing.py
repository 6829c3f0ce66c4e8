"""Tests for kvtier.client.hashing: the chained block keys and their encoding."""

from __future__ import annotations

import array
import hashlib
import json
import os
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.client.hashing import (
    HASH_ALGOS,
    HASH_BYTES,
    ROOT_TAG,
    BlockHasher,
    MultiModalItem,
    hash_token_blocks,
)

BS = 4


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**31, size=n).tolist()


def reference_hashes(
    token_ids: list[int],
    block_size: int,
    algo: str = "xxh3_128",
    lora_id: int | str | None = None,
    mm_items: list[tuple[bytes, int, int]] = [],  # noqa: B006 - never mutated
    salt: bytes | None = None,
) -> list[bytes]:
    """The module docstring's encoding, written out independently of the module.

    If this and BlockHasher ever disagree, either the code or the spec that a
    C++/Rust client would follow is wrong.
    """

    def h(data: bytes) -> bytes:
        if algo == "sha256":
            return hashlib.sha256(data).digest()[:16]
        return xxhash.xxh3_128_digest(data)

    parent = h(b"kvtier/block-hash/v1")
    out = []
    for b in range(len(token_ids) // block_size):
        block = token_ids[b * block_size : (b + 1) * block_size]
        lo, hi = b * block_size, (b + 1) * block_size
        mm = sorted(
            ([ih, off - lo] for ih, off, length in mm_items if off < hi and off + length > lo),
            key=lambda k: (k[1], k[0]),
        )
        extra = msgpack.packb([lora_id, mm, salt if b == 0 else None], use_bin_type=True)
        msg = parent + struct.pack("<I", block_size) + b"".join(struct.pack("<q", t) for t in block) + extra
        parent = h(msg)
        out.append(parent)
    return out


# ---------------------------------------------------------------- basics


def test_constants() -> None:
    assert HASH_BYTES == 16
    assert HASH_ALGOS == ("xxh3_128", "sha256")
    assert ROOT_TAG == b"kvtier/block-hash/v1"


def test_partial_blocks_get_no_hash() -> None:
    h = BlockHasher(BS)
    assert h.hash_blocks([]) == []
    assert h.hash_blocks([1, 2, 3]) == []
    full = h.hash_blocks(tokens(8))
    assert len(full) == 2
    # The partial tail neither adds a key nor changes the full blocks' keys.
    assert h.hash_blocks(tokens(8) + [7, 7, 7]) == full


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_keys_are_16_bytes(algo: str) -> None:
    keys = BlockHasher(BS, algo).hash_blocks(tokens(40))
    assert len(keys) == 10
    assert all(type(k) is bytes and len(k) == HASH_BYTES for k in keys)
    assert len(set(keys)) == 10


def test_chain_property() -> None:
    h = BlockHasher(BS)
    base = tokens(6 * BS)
    ref = h.hash_blocks(base)

    first = list(base)
    first[0] += 1
    changed = h.hash_blocks(first)
    assert all(a != b for a, b in zip(ref, changed))

    mid = list(base)
    mid[2 * BS + 1] += 1
    changed = h.hash_blocks(mid)
    assert changed[:2] == ref[:2]
    assert all(a != b for a, b in zip(ref[2:], changed[2:]))


def test_same_block_content_different_prefix_differs() -> None:
    h = BlockHasher(BS)
    a = h.hash_blocks([1, 2, 3, 4, 9, 9, 9, 9])
    b = h.hash_blocks([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]


def test_matches_reference_encoding() -> None:
    toks = tokens(5 * BS + 2, seed=3)
    mm = [(b"img-a", 3, 6), (b"img-b", 9, 2), (b"img-0", 9, 1)]
    for algo in HASH_ALGOS:
        got = BlockHasher(BS, algo).hash_blocks(
            toks,
            lora_id=7,
            mm_items=[MultiModalItem(*m) for m in mm],
            cache_salt=b"tenant",
        )
        assert got == reference_hashes(toks, BS, algo, lora_id=7, mm_items=mm, salt=b"tenant")
        assert BlockHasher(BS, algo).hash_blocks(toks) == reference_hashes(toks, BS, algo)


def test_hash_block_steps_equal_hash_blocks() -> None:
    h = BlockHasher(BS)
    toks = tokens(3 * BS, seed=5)
    item = MultiModalItem(b"pic", 2, 4)  # covers blocks 0 and 1
    whole = h.hash_blocks(toks, lora_id="adapter", mm_items=[item], cache_salt="s")
    k0 = h.hash_block(None, toks[:BS], ("adapter", [(b"pic", 2)], "s"))
    k1 = h.hash_block(k0, toks[BS : 2 * BS], ("adapter", [(b"pic", 2 - BS)], None))
    k2 = h.hash_block(k1, toks[2 * BS :], ("adapter", [], None))
    assert [k0, k1, k2] == whole
    assert h.hash_block(None, toks[:BS]) == h.hash_blocks(toks[:BS])[0]
    assert h.hash_block(None, toks[:BS], None) == h.hash_block(None, toks[:BS], (None, (), None))


def test_hash_block_rejects_wrong_length() -> None:
    h = BlockHasher(BS)
    with pytest.raises(ValueError, match="exactly block_size"):
        h.hash_block(None, [1, 2, 3])
    with pytest.raises(TypeError, match="extra"):
        h.hash_block(None, [1, 2, 3, 4], (None, ()))


def test_root_and_empty_extra_encoding() -> None:
    assert BlockHasher(BS).root == xxhash.xxh3_128_digest(ROOT_TAG)
    assert BlockHasher(BS, "sha256").root == hashlib.sha256(ROOT_TAG).digest()[:16]
    # The "no extra keys" example given in the module docstring.
    assert msgpack.packb([None, [], None], use_bin_type=True) == bytes.fromhex("93c090c0")
    expected = xxhash.xxh3_128_digest(
        BlockHasher(BS).root + struct.pack("<I", BS) + struct.pack("<4q", 1, 2, 3, 4) + bytes.fromhex("93c090c0")
    )
    assert BlockHasher(BS).hash_blocks([1, 2, 3, 4]) == [expected]


# Computed once from this implementation. A change here means every key a
# deployed daemon or a non-Python client holds is invalidated: bump ROOT_TAG.
GOLDEN_ROOT = {"xxh3_128": "118f9a0bdbf716d1a7f2d01b186405fb", "sha256": "80171cc48a1b94c5bf645a5642638eda"}
GOLDEN = {
    "xxh3_128": ["1fcbfb5906d4451c9954fb9968c3663e", "2dbadedc9ce6780d96792dbf1ca87254"],
    "sha256": ["82250150f94f30fb95c65fedd19e539b", "94dfa1347ae67859e14aca4ee1a7c69a"],
}


def golden_input() -> dict:
    return dict(
        token_ids=list(range(100, 132)) + [2**31, 5],
        block_size=16,
        lora_id=3,
        mm_items=[MultiModalItem(b"\x01" * 16, 10, 12)],
        cache_salt="golden",
    )


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_golden_values(algo: str) -> None:
    assert BlockHasher(16, algo).root.hex() == GOLDEN_ROOT[algo]
    keys = hash_token_blocks(algo=algo, **golden_input())
    assert [k.hex() for k in keys] == GOLDEN[algo]


_SUBPROCESS_SNIPPET = """
import json, sys
from kvtier.client.hashing import BlockHasher, MultiModalItem
assert "torch" not in sys.modules
out = {}
for algo in ("xxh3_128", "sha256"):
    h = BlockHasher(16, algo)
    out[algo] = [k.hex() for k in h.hash_blocks(
        list(range(1000)), lora_id="lora-x",
        mm_items=[MultiModalItem("image-hash", 40, 100)], cache_salt="salt")]
print(json.dumps(out))
"""


def test_deterministic_across_processes() -> None:
    expected = {}
    for algo in HASH_ALGOS:
        h = BlockHasher(16, algo)
        expected[algo] = [
            k.hex()
            for k in h.hash_blocks(
                list(range(1000)),
                lora_id="lora-x",
                mm_items=[MultiModalItem("image-hash", 40, 100)],
                cache_salt="salt",
            )
        ]
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SNIPPET], env=env, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout) == expected


def test_import_does_not_load_torch() -> None:
    res = subprocess.run(
        [sys.executable, "-c", "import kvtier.client.hashing, sys; assert 'torch' not in sys.modules"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- extra keys


def test_salt_changes_every_key() -> None:
    h = BlockHasher(BS)
    toks = tokens(5 * BS)
    plain = h.hash_blocks(toks)
    salted = h.hash_blocks(toks, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(plain, salted))
    assert h.hash_blocks(toks, cache_salt="tenant-a") == salted
    other = h.hash_blocks(toks, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(other, salted))


def test_salt_only_enters_first_block() -> None:
    h = BlockHasher(BS)
    toks = tokens(3 * BS)
    salted = h.hash_blocks(toks, cache_salt="s")
    k0 = h.hash_block(None, toks[:BS], (None, (), "s"))
    assert salted[0] == k0
    # Later blocks are plain chain steps from the salted first key.
    assert salted[1] == h.hash_block(k0, toks[BS : 2 * BS])


def test_salt_str_equals_its_utf8_bytes_and_empty_means_none() -> None:
    h = BlockHasher(BS)
    toks = tokens(2 * BS)
    assert h.hash_blocks(toks, cache_salt="é") == h.hash_blocks(toks, cache_salt="é".encode())
    # Documented choice (as vLLM): an empty salt isolates nothing, so it is no salt.
    assert h.hash_blocks(toks, cache_salt="") == h.hash_blocks(toks)
    assert h.hash_blocks(toks, cache_salt=b"") == h.hash_blocks(toks)


def test_lora_isolation() -> None:
    h = BlockHasher(BS)
    toks = tokens(3 * BS)
    variants = [None, 0, 1, 2, "1", "adapter"]
    results = [tuple(h.hash_blocks(toks, lora_id=v)) for v in variants]
    for i in range(len(results)):
        for j in range(i + 1, len(results)):
            assert all(a != b for a, b in zip(results[i], results[j])), (variants[i], variants[j])
    assert h.hash_blocks(toks, lora_id=1) == h.hash_blocks(toks, lora_id=np.int64(1))


def test_multimodal_affects_overlapped_blocks_and_later() -> None:
    h = BlockHasher(BS)
    toks = tokens(6 * BS)
    plain = h.hash_blocks(toks)
    # Item covers absolute positions 9..14: blocks 2 and 3.
    item = MultiModalItem(b"image", 9, 6)
    with_mm = h.hash_blocks(toks, mm_items=[item])
    assert with_mm[:2] == plain[:2]
    assert all(a != b for a, b in zip(plain[2:], with_mm[2:]))
    # Blocks 4 and 5 differ only through the chain: same step from new parent.
    assert with_mm[4] == h.hash_block(with_mm[3], toks[4 * BS : 5 * BS])
    # Block 3 carries the item with a negative relative offset (9 - 12).
    assert with_mm[3] == h.hash_block(with_mm[2], toks[3 * BS : 4 * BS], (None, [(b"image", -3)], None))


def test_multimodal_boundaries() -> None:
    h = BlockHasher(BS)
    toks = tokens(4 * BS)
    plain = h.hash_blocks(toks)
    # Ends exactly at a block boundary: positions 4..7, block 1 only.
    exact = h.hash_blocks(toks, mm_items=[MultiModalItem(b"x", 4, 4)])
    assert exact[0] == plain[0] and exact[1] != plain[1]
    assert exact[2] == h.hash_block(exact[1], toks[2 * BS : 3 * BS])
    # Beyond the last full block: no full block touched, nothing changes.
    assert h.hash_blocks(toks + [1, 2], mm_items=[MultiModalItem(b"x", 16, 2)]) == plain


def test_multimodal_relative_offset_and_hash_matter() -> None:
    h = BlockHasher(BS)
    toks = [0] * (4 * BS)
    at1 = h.hash_blocks(toks, mm_items=[MultiModalItem(b"img", 1, 2)])
    at2 = h.hash_blocks(toks, mm_items=[MultiModalItem(b"img", 2, 2)])
    other = h.hash_blocks(toks, mm_items=[MultiModalItem(b"img2", 1, 2)])
    assert at1[0] != at2[0] and at1[0] != other[0]
    # Relative offset 1 in block 1 instead of block 0: block 0 is untouched,
    # block 1 now carries the item, so the keys part ways from there.
    plain = h.hash_blocks(toks)
    at5 = h.hash_blocks(toks, mm_items=[MultiModalItem(b"img", 5, 2)])
    assert at5[0] == plain[0]
    assert at5[1] not in (plain[1], at1[1])


def test_multimodal_order_and_str_hash_are_canonical() -> None:
    h = BlockHasher(BS)
    toks = tokens(4 * BS)
    a = MultiModalItem(b"a", 1, 3)
    b = MultiModalItem(b"b", 1, 6)
    c = MultiModalItem(b"c", 6, 2)
    assert h.hash_blocks(toks, mm_items=[a, b, c]) == h.hash_blocks(toks, mm_items=[c, b, a])
    assert h.hash_blocks(toks, mm_items=[MultiModalItem("hex", 0, 2)]) == h.hash_blocks(
        toks, mm_items=[(b"hex", 0, 2)]
    )


# ---------------------------------------------------------------- algos and continuation


def test_algos_differ() -> None:
    toks = tokens(4 * BS)
    x = BlockHasher(BS, "xxh3_128").hash_blocks(toks)
    s = BlockHasher(BS, "sha256").hash_blocks(toks)
    assert all(len(k) == 16 for k in x + s)
    assert all(a != b for a, b in zip(x, s))


def test_unknown_algo_and_bad_block_size() -> None:
    with pytest.raises(ValueError, match="xxh3_128, sha256"):
        BlockHasher(BS, "md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
    with pytest.raises(TypeError, match="block_size"):
        BlockHasher(2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_continuation_equals_whole(salt: str | None) -> None:
    bs = 16
    h = BlockHasher(bs)
    toks = tokens(13 * bs + 5, seed=9)
    items = [MultiModalItem(b"spans-split", 7 * bs + 3, 2 * bs), MultiModalItem(b"late", 11 * bs, 5)]
    whole = h.hash_blocks(toks, cache_salt=salt, lora_id=4, mm_items=items)
    head = h.hash_blocks(toks[: 8 * bs], cache_salt=salt, lora_id=4, mm_items=items)
    tail = h.hash_blocks(
        toks[8 * bs :], parent=head[-1], start_block=8, cache_salt=salt, lora_id=4, mm_items=items
    )
    assert head + tail == whole


def test_inputs_of_every_kind_agree() -> None:
    torch = pytest.importorskip("torch")
    h = BlockHasher(BS)
    toks = tokens(3 * BS)
    ref = h.hash_blocks(toks)
    assert h.hash_blocks(tuple(toks)) == ref
    assert h.hash_blocks(np.array(toks, dtype=np.int64)) == ref
    assert h.hash_blocks(np.array(toks, dtype=np.uint32)) == ref
    assert h.hash_blocks(np.array(toks, dtype=">i8")) == ref  # big-endian input
    assert h.hash_blocks(array.array("q", toks)) == ref
    assert h.hash_blocks(torch.tensor(toks, dtype=torch.int64)) == ref
    assert h.hash_blocks(torch.tensor(toks, dtype=torch.int32)) == ref
    assert h.hash_blocks(range(3 * BS)) == h.hash_blocks(list(range(3 * BS)))


def test_token_ids_up_to_2_63() -> None:
    h = BlockHasher(2)
    assert len(h.hash_blocks([2**31, 2**63 - 1])) == 1
    assert h.hash_blocks([2**31, 1]) != h.hash_blocks([2**31 - 1, 1])


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ([1, -1], ValueError, ">= 0"),
        (np.array([3, -2], dtype=np.int16), ValueError, ">= 0"),
        ([1, 2**63], ValueError, "outside"),
        (np.array([2**64 - 1], dtype=np.uint64), ValueError, "outside"),
        ([1, 2.5], TypeError, r"token_ids\[1\] must be an int"),
        ([1.0, 2.0], TypeError, "must be an int"),
        ([1, None], TypeError, "NoneType"),
        ([True, False], TypeError, "bool"),
        (np.zeros(4, dtype=np.float32), TypeError, "dtype float32"),
        ("abcd", TypeError, "sequence of ints"),
        ([[1, 2], [3, 4]], ValueError, "one-dimensional"),
    ],
)
def test_bad_tokens(bad: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        BlockHasher(2).hash_blocks(bad)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    h = BlockHasher(2)
    with pytest.raises(ValueError, match="exactly 16 bytes"):
        h.hash_blocks([1, 2], parent=b"short", start_block=1)
    with pytest.raises(TypeError, match="parent"):
        h.hash_blocks([1, 2], parent="x" * 16, start_block=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass parent"):
        h.hash_blocks([1, 2], start_block=3)
    with pytest.raises(ValueError, match="start_block"):
        h.hash_blocks([1, 2], parent=b"\0" * 16)
    with pytest.raises(ValueError, match="start_block"):
        h.hash_blocks([1, 2], start_block=-1)
    with pytest.raises(TypeError, match="lora_id"):
        h.hash_blocks([1, 2], lora_id=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lora_id"):
        h.hash_blocks([1, 2], lora_id=True)
    with pytest.raises(ValueError, match="lora_id"):
        h.hash_blocks([1, 2], lora_id=2**64)
    with pytest.raises(TypeError, match="cache_salt"):
        h.hash_blocks([1, 2], cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="single item"):
        h.hash_blocks([1, 2], mm_items=MultiModalItem(b"a", 0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mm_items"):
        h.hash_blocks([1, 2], mm_items=[42])  # type: ignore[list-item]


def test_multimodal_item_validation() -> None:
    assert MultiModalItem("ab", np.int64(3), 2) == MultiModalItem(b"ab", 3, 2)
    with pytest.raises(ValueError, match="empty"):
        MultiModalItem(b"", 0, 1)
    with pytest.raises(ValueError, match="offset"):
        MultiModalItem(b"a", -1, 1)
    with pytest.raises(ValueError, match="length"):
        MultiModalItem(b"a", 0, 0)
    with pytest.raises(TypeError, match="item_hash"):
        MultiModalItem(123, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="offset"):
        MultiModalItem(b"a", 1.0, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(
    toks=st.lists(st.integers(min_value=0, max_value=2**31), max_size=200),
    block_size=st.integers(min_value=1, max_value=33),
    split=st.integers(min_value=0, max_value=10),
    salt=st.one_of(st.none(), st.text(max_size=5)),
    algo=st.sampled_from(HASH_ALGOS),
)
def test_property_count_and_continuation(
    toks: list[int], block_size: int, split: int, salt: str | None, algo: str
) -> None:
    h = BlockHasher(block_size, algo)
    whole = h.hash_blocks(toks, cache_salt=salt)
    assert len(whole) == len(toks) // block_size
    k = min(split, len(whole))
    if k == 0:
        return
    head = h.hash_blocks(toks[: k * block_size], cache_salt=salt)
    tail = h.hash_blocks(toks[k * block_size :], parent=head[-1], start_block=k, cache_salt=salt)
    assert head + tail == whole


@settings(max_examples=60, deadline=None)
@given(
    toks=st.lists(st.integers(min_value=0, max_value=2**40), min_size=1, max_size=60),
    block_size=st.integers(min_value=1, max_value=8),
    items=st.lists(
        st.tuples(st.binary(min_size=1, max_size=4), st.integers(0, 70), st.integers(1, 20)), max_size=4
    ),
    lora=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=4)),
)
def test_property_matches_reference(
    toks: list[int], block_size: int, items: list[tuple[bytes, int, int]], lora: int | str | None
) -> None:
    got = BlockHasher(block_size).hash_blocks(toks, lora_id=lora, mm_items=items, cache_salt=b"s")
    assert got == reference_hashes(toks, block_size, lora_id=lora, mm_items=items, salt=b"s")


def test_speed_sanity() -> None:
    # Not a benchmark: catches a per-token Python loop sneaking into the fast
    # path (that would take on the order of a second here, not milliseconds).
    toks = np.random.default_rng(1).integers(0, 2**31, size=100_000)
    for algo in HASH_ALGOS:
        h = BlockHasher(16, algo)
        t0 = time.perf_counter()
        keys = h.hash_blocks(toks)
        elapsed = time.perf_counter() - t0
        assert len(keys) == 6250
        assert elapsed < 2.0, f"{algo}: {elapsed:.3f}s for 100k tokens"
