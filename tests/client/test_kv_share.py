"""Tests for kvtier.client.kv_share: exporting engine KV tensors and importing them in another process."""

from __future__ import annotations

import copy
import functools
import gc
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch

from kvtier.client.kv_description import validate_kv_description, validate_tensor_description
from kvtier.client.kv_share import (
    SUPPORTED_DTYPES,
    KvShareError,
    allocate_shared_kv,
    export_kv,
    export_tensor,
    unlink_shared_kv,
)
from kvtier.client.shm_arena import SHM_DIR
from kvtier.daemon.shared_memory.kv_import import import_kv, import_tensor

NUM_BLOCKS = 6
# pytest-xdist's workers share /dev/shm: this module's files carry its own
# process's prefix, so the leak check below sees (and removes) only what these
# tests made, never another worker's live engine memory.
PREFIX = f"kvtier-kvtest_{os.getpid()}"
_allocate = functools.partial(allocate_shared_kv, name_prefix=PREFIX)

# Layouts engines use: (name, dtype, per-tensor (shape, block_dim) in the engine).
# "views" allocates one buffer for all layers and registers per-layer views of it,
# so offsets into a shared storage are exercised.
LAYOUTS: dict[str, tuple[str, list[tuple[list[int], int]]]] = {
    "per_layer_block_dim_1": ("float16", [([2, NUM_BLOCKS, 4, 2, 8], 1)] * 3),
    "per_layer_block_dim_0": ("bfloat16", [([NUM_BLOCKS, 2, 4, 2, 8], 0)] * 2),
    "views_of_one_buffer": ("float32", []),
    "mixed_shapes": ("int8", [([NUM_BLOCKS, 3, 5], 0), ([7, NUM_BLOCKS, 16], 1)]),
}

# The child plays the engine: it allocates, fills with seeded bytes, exports, and
# prints the msgpack'd description; then it checks the bytes the parent wrote.
CHILD = r"""
import sys, msgpack, torch
from kvtier.client.kv_share import allocate_shared_kv, export_kv, export_tensor

def fill(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(torch.uint8).reshape(-1)
        data = torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g)
        flat.copy_(data.to(flat.device))

layout, device = sys.argv[1], sys.argv[2]
dtype = getattr(torch, sys.argv[3])
specs = msgpack.unpackb(bytes.fromhex(sys.argv[4]))
if layout == "views_of_one_buffer":
    if device == "cpu":
        whole, _ = allocate_shared_kv([3, 2, %(n)d, 4, 2, 8], dtype, 2, name_prefix=%(prefix)r)
    else:
        whole = torch.empty([3, 2, %(n)d, 4, 2, 8], dtype=dtype, device=device)
    tensors, dims = [whole[i] for i in range(3)], [1, 1, 1]
else:
    tensors, dims = [], []
    for shape, block_dim in specs:
        if device == "cpu":
            t, _ = allocate_shared_kv(shape, dtype, block_dim, name_prefix=%(prefix)r)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        tensors.append(t)
        dims.append(block_dim)
fill(tensors, 1)
if device != "cpu":
    torch.cuda.synchronize()
print(msgpack.packb(export_kv(tensors, dims)).hex(), flush=True)
print(msgpack.packb([export_tensor(t) for t in tensors]).hex(), flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        if device != "cpu":
            torch.cuda.synchronize()
        expected = [t.clone() for t in tensors]
        fill(expected, 2)
        ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, expected))
        print("ok" if ok else "MISMATCH", flush=True)
    elif line.strip() == "exit":
        break
""" % {"n": NUM_BLOCKS, "prefix": PREFIX}


def fill(tensors: list[torch.Tensor], seed: int) -> None:
    """Seeded random bytes into every byte of each (contiguous) tensor; the same as the child's."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(torch.uint8).reshape(-1)
        data = torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g)
        flat.copy_(data.to(flat.device))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Compare bits, not values: random bytes make NaNs, and NaN != NaN.
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Engine:
    """A child process holding shared KV tensors; speaks a line protocol on stdin/stdout."""

    def __init__(self, layout: str, device: str) -> None:
        dtype, specs = LAYOUTS[layout]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, layout, device, dtype, msgpack.packb(specs).hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.wait(timeout=60)
            raise AssertionError(f"engine child failed: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.desc: dict[str, Any] = msgpack.unpackb(bytes.fromhex(line.strip()))
        assert self.proc.stdout
        self.tensor_descs: list[dict[str, Any]] = msgpack.unpackb(bytes.fromhex(self.proc.stdout.readline().strip()))

    def ask(self, line: str) -> str:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def finish(self) -> None:
        if self.proc.poll() is None and self.proc.stdin:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)
        assert self.proc.returncode == 0, self.proc.stderr.read() if self.proc.stderr else ""


def expected_tensors(layout: str, seed: int) -> tuple[list[torch.Tensor], list[int]]:
    dtype_name, specs = LAYOUTS[layout]
    dtype = getattr(torch, dtype_name)
    if layout == "views_of_one_buffer":
        whole = torch.empty([3, 2, NUM_BLOCKS, 4, 2, 8], dtype=dtype)
        tensors, dims = [whole[i] for i in range(3)], [1, 1, 1]
    else:
        tensors = [torch.empty(shape, dtype=dtype) for shape, _ in specs]
        dims = [d for _, d in specs]
    fill(tensors, seed)
    return tensors, dims


def run_cross_process(layout: str, device: str) -> None:
    engine = Engine(layout, device)
    try:
        desc = engine.desc
        assert desc["transport"] == ("shm" if device == "cpu" else "cuda_ipc")
        assert desc["num_blocks"] == NUM_BLOCKS
        tensors, block_dims, closer = import_kv(desc)
        want, want_dims = expected_tensors(layout, 1)
        assert block_dims == want_dims
        assert len(tensors) == len(want)
        for got, exp in zip(tensors, want):
            assert got.dtype == exp.dtype and got.device.type == device.split(":")[0]
            assert same_bytes(got.cpu(), exp), "daemon side does not see the engine's bytes"

        layout_mod = pytest.importorskip("kvtier.blocks.layout")
        imported = layout_mod.BlockLayout(tensors, block_dims)
        local = layout_mod.BlockLayout(want, want_dims)
        assert imported.num_blocks == NUM_BLOCKS and imported.block_bytes == local.block_bytes
        slots = list(range(NUM_BLOCKS))
        assert torch.equal(imported.gather(slots).cpu(), local.gather(slots))

        # The per-tensor wire form (register_kv's {desc, block_dim} entries) maps the same memory.
        singles = [import_tensor(d) for d in engine.tensor_descs]
        for (single, single_closer), exp in zip(singles, want):
            assert same_bytes(single.cpu(), exp)
            single_closer.close()
        del singles, single

        written, _ = expected_tensors(layout, 2)
        for got, new in zip(tensors, written):
            got.copy_(new.to(got.device))
        if device != "cpu":
            torch.cuda.synchronize()
        assert engine.ask("check") == "ok", "engine does not see the daemon's bytes"
        del tensors, imported
        closer()
        assert closer.closed
    finally:
        engine.finish()


@pytest.fixture(autouse=True)
def no_leaked_shm_files() -> Iterator[None]:
    before = set(SHM_DIR.glob(f"{PREFIX}-*"))
    yield
    # Names go when tensors do: collect cycles, and give an exiting engine
    # process (a busy machine is slow to reap) a few seconds, before calling it a leak.
    deadline = time.monotonic() + 5.0
    while set(SHM_DIR.glob(f"{PREFIX}-*")) - before and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    leaked = set(SHM_DIR.glob(f"{PREFIX}-*")) - before
    for path in leaked:
        path.unlink()
    assert not leaked, f"shm KV files left behind: {sorted(map(str, leaked))}"


# -- CPU transport: /dev/shm ------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shm_cross_process_every_byte(layout: str) -> None:
    run_cross_process(layout, "cpu")


def test_import_survives_engine_exit() -> None:
    engine = Engine("per_layer_block_dim_1", "cpu")
    names = {t["handle"]["name"] for t in engine.desc["tensors"]}
    tensors, _, closer = import_kv(engine.desc)
    engine.finish()
    # The engine is gone and took the names with it; our mapping still holds the bytes.
    assert not any((SHM_DIR / n).exists() for n in names)
    want, _ = expected_tensors("per_layer_block_dim_1", 1)
    assert all(same_bytes(a, b) for a, b in zip(tensors, want))
    closer()


def test_export_then_import_in_one_process_shares_memory() -> None:
    kv, handle = _allocate([2, NUM_BLOCKS, 4, 8], torch.float16, 1)
    assert handle["kind"] == "shm" and handle["size_bytes"] == kv.numel() * 2
    assert (SHM_DIR / handle["name"]).exists()
    assert kv.is_contiguous() and not kv.any()
    desc = export_kv([kv[0], kv[1]], [0, 0])
    assert [t["storage_offset"] for t in desc["tensors"]] == [0, NUM_BLOCKS * 4 * 8]
    assert msgpack.unpackb(msgpack.packb(desc)) == desc, "description must survive msgpack"
    (k, v), dims, closer = import_kv(desc)
    assert dims == [0, 0]
    kv[1, 3].fill_(7)
    assert torch.all(v[3] == 7) and not k.any()
    k[2, 1].fill_(-1)
    assert torch.all(kv[0, 2, 1] == -1)
    del k, v
    closer()
    closer()  # idempotent


def test_strided_views_are_exported_exactly() -> None:
    kv, _ = _allocate([NUM_BLOCKS, 2, 4, 8], torch.float32, 0)
    fill([kv], 3)
    views = [kv[:, 1], kv[:, :, 1:3], kv.transpose(2, 3)]
    desc = export_kv(views, [0, 0, 0])
    got, dims, closer = import_kv(desc)
    for g, v in zip(got, views):
        assert g.shape == v.shape and g.stride() == v.stride()
        assert same_bytes(g, v)
    del got
    closer()


def test_negative_block_dim_is_normalised() -> None:
    kv, _ = _allocate([2, NUM_BLOCKS], torch.int32, -1)
    assert export_kv([kv], [-1])["tensors"][0]["block_dim"] == 1


def test_file_name_goes_when_tensor_does() -> None:
    kv, handle = _allocate([NUM_BLOCKS, 16], torch.uint8, 0)
    view = kv[2:]
    path = SHM_DIR / handle["name"]
    del kv
    gc.collect()
    assert path.exists(), "a live view keeps the name"
    del view
    gc.collect()
    assert not path.exists()


def test_unlink_shared_kv_by_tensor_or_handle() -> None:
    kv, handle = _allocate([NUM_BLOCKS, 16], torch.uint8, 0)
    unlink_shared_kv(kv)
    assert not (SHM_DIR / handle["name"]).exists()
    unlink_shared_kv(handle)  # idempotent
    kv.fill_(1)  # the mapping outlives the name
    desc = export_kv([kv], [0])
    with pytest.raises(KvShareError, match="does not exist"):
        import_kv(desc)
    with pytest.raises(KvShareError):
        unlink_shared_kv(torch.zeros(3))
    with pytest.raises(KvShareError):
        unlink_shared_kv({"kind": "shm", "name": "../etc/passwd", "size_bytes": 1})


def test_module_does_not_import_torch_at_load() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys, kvtier.client.kv_share; assert 'torch' not in sys.modules"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


# -- export refuses what cannot be shared ----------------------------------------------------


def test_export_refuses_private_cpu_memory() -> None:
    with pytest.raises(KvShareError, match="allocate_shared_kv"):
        export_kv([torch.zeros(NUM_BLOCKS, 4)], [0])


def test_export_checks_block_dims_and_counts() -> None:
    a, _ = _allocate([NUM_BLOCKS, 4], torch.float16, 0)
    b, _ = _allocate([NUM_BLOCKS + 1, 4], torch.float16, 0)
    with pytest.raises(KvShareError, match="blocks"):
        export_kv([a, b], [0, 0])
    with pytest.raises(KvShareError):
        export_kv([a], [0, 0])
    with pytest.raises(KvShareError):
        export_kv([], [])
    with pytest.raises(KvShareError, match="out of range"):
        export_kv([a], [2])
    with pytest.raises(KvShareError, match="out of range"):
        export_kv([a], [True])
    with pytest.raises(KvShareError, match="one device"):
        export_kv([a, torch.empty(NUM_BLOCKS, 4, device="meta")], [0, 0])


@pytest.mark.parametrize(
    "shape, dtype, block_dim",
    [
        ([], torch.float16, 0),
        ([0, 4], torch.float16, 0),
        ([4, -1], torch.float16, 0),
        ([4, 4], torch.float16, 2),
        ([4, 4], torch.complex64, 0),
        ([4, 4], torch.bool, 0),
        ([4, 4], "float128", 0),
        ([4, 4], 5, 0),
    ],
)
def test_allocate_refuses_bad_arguments(shape: list[int], dtype: Any, block_dim: int) -> None:
    with pytest.raises(KvShareError):
        _allocate(shape, dtype, block_dim)


def test_allocate_refuses_bad_name_prefix() -> None:
    with pytest.raises(KvShareError):
        allocate_shared_kv([4], torch.uint8, 0, name_prefix="../evil")


def test_allocate_accepts_dtype_names() -> None:
    kv, _ = _allocate([NUM_BLOCKS, 2], "bfloat16", 0)
    assert kv.dtype == torch.bfloat16


# -- hostile descriptions ---------------------------------------------------------------------


@pytest.fixture
def valid_desc() -> Iterator[dict[str, Any]]:
    kv, _ = _allocate([2, NUM_BLOCKS, 4, 2, 8], torch.float16, 1)
    yield export_kv([kv[0], kv[1]], [0, 0])
    del kv


def t0(desc: dict[str, Any]) -> dict[str, Any]:
    return desc["tensors"][0]


HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "stride past the end": lambda d: t0(d).update(stride=[1000, 16, 8, 1]),
    "offset past the end": lambda d: d["tensors"][1].update(storage_offset=NUM_BLOCKS * 64 + 1),
    "shape past the end": lambda d: d["tensors"][1].update(shape=[NUM_BLOCKS, 4, 2, 9]),
    "wider dtype past the end": lambda d: d["tensors"][1].update(dtype="float64"),
    "negative stride": lambda d: t0(d).update(stride=[64, 16, 8, -1]),
    "negative offset": lambda d: t0(d).update(storage_offset=-1),
    "huge offset": lambda d: t0(d).update(storage_offset=2**70),
    "string size": lambda d: t0(d).update(shape=[NUM_BLOCKS, "4", 2, 8]),
    "float stride": lambda d: t0(d).update(stride=[64.0, 16, 8, 1]),
    "zero size": lambda d: t0(d).update(shape=[NUM_BLOCKS, 0, 2, 8]),
    "stride rank mismatch": lambda d: t0(d).update(stride=[64, 16, 8]),
    "too many dims": lambda d: t0(d).update(shape=[1] * 8 + [NUM_BLOCKS], stride=[1] * 9, block_dim=8),
    "no dims": lambda d: t0(d).update(shape=[], stride=[]),
    "zero block stride": lambda d: t0(d).update(stride=[0, 16, 8, 1]),
    "unknown dtype": lambda d: t0(d).update(dtype="float128"),
    "complex dtype": lambda d: t0(d).update(dtype="complex64"),
    "dtype not a string": lambda d: t0(d).update(dtype=5),
    "block_dim negative": lambda d: t0(d).update(block_dim=-1),
    "block_dim too big": lambda d: t0(d).update(block_dim=4),
    "block_dim bool": lambda d: t0(d).update(block_dim=True),
    "num_blocks mismatch": lambda d: d.update(num_blocks=NUM_BLOCKS + 1),
    "tensor num_blocks mismatch": lambda d: t0(d).update(shape=[NUM_BLOCKS - 1, 4, 2, 8]),
    "block_dim picks wrong dim": lambda d: t0(d).update(block_dim=1),
    "zero num_blocks": lambda d: d.update(num_blocks=0),
    "no tensors": lambda d: d.update(tensors=[]),
    "tensors not a list": lambda d: d.update(tensors={"a": 1}),
    "too many tensors": lambda d: d.update(tensors=d["tensors"] * 3000),
    "unknown top key": lambda d: d.update(extra=1),
    "missing top key": lambda d: d.pop("num_blocks"),
    "unknown tensor key": lambda d: t0(d).update(device="cpu"),
    "missing tensor key": lambda d: t0(d).pop("stride"),
    "wrong version": lambda d: d.update(version=2),
    "unknown transport": lambda d: d.update(transport="rdma"),
    "handle kind mismatch": lambda d: t0(d)["handle"].update(kind="cuda_ipc"),
    "handle not a map": lambda d: t0(d).update(handle="kvtier-kv-x"),
    "handle unknown key": lambda d: t0(d)["handle"].update(path="/dev/shm/x"),
    "name traversal": lambda d: t0(d)["handle"].update(name="../../etc/passwd"),
    "name traversal after prefix": lambda d: t0(d)["handle"].update(name="kvtier-../../etc/passwd"),
    "name outside prefix": lambda d: t0(d)["handle"].update(name="torch_123"),
    "name absolute": lambda d: t0(d)["handle"].update(name="/dev/shm/kvtier-kv-x"),
    "size not int": lambda d: t0(d)["handle"].update(size_bytes="1280"),
    "size zero": lambda d: t0(d)["handle"].update(size_bytes=0),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_descriptions_are_rejected(valid_desc: dict[str, Any], case: str) -> None:
    desc = copy.deepcopy(valid_desc)
    HOSTILE[case](desc)
    with pytest.raises(KvShareError):
        validate_kv_description(desc)
    with pytest.raises(KvShareError):
        import_kv(desc)


def test_single_tensor_round_trip() -> None:
    kv, _ = _allocate([2, NUM_BLOCKS, 4, 8], torch.bfloat16, 1)
    desc = export_tensor(kv[1])
    assert "block_dim" not in desc and desc["transport"] == "shm"
    assert desc["storage_offset"] == NUM_BLOCKS * 4 * 8
    assert msgpack.unpackb(msgpack.packb(desc)) == desc
    tensor, closer = import_tensor(desc)
    kv[1, 2].fill_(5)
    assert torch.all(tensor[2] == 5) and tensor.shape == kv[1].shape
    del tensor
    closer.close()
    with pytest.raises(KvShareError, match="allocate_shared_kv"):
        export_tensor(torch.zeros(4))


SINGLE_HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "past the end": lambda d: d.update(storage_offset=d["storage_offset"] + 1),
    "unknown dtype": lambda d: d.update(dtype="float128"),
    "block_dim does not belong here": lambda d: d.update(block_dim=0),
    "missing handle": lambda d: d.pop("handle"),
    "bad version": lambda d: d.update(version=0),
    "traversal": lambda d: d["handle"].update(name="kvtier-../x"),
}


@pytest.mark.parametrize("case", sorted(SINGLE_HOSTILE))
def test_hostile_single_tensor_descriptions_are_rejected(case: str) -> None:
    kv, _ = _allocate([2, NUM_BLOCKS, 4, 8], torch.float16, 1)
    desc = copy.deepcopy(export_tensor(kv[1]))
    SINGLE_HOSTILE[case](desc)
    with pytest.raises(KvShareError):
        validate_tensor_description(desc)
    with pytest.raises(ValueError):  # KvShareError is a ValueError: the daemon's handlers catch it as such
        import_tensor(desc)


@pytest.mark.parametrize("desc", [None, [], "desc", 5, {"version": 1}])
def test_non_descriptions_are_rejected(desc: object) -> None:
    with pytest.raises(KvShareError):
        import_kv(desc)


def test_declared_size_must_match_the_file(valid_desc: dict[str, Any]) -> None:
    # Bounds pass against the declared size; the real file must have exactly that size.
    for entry in valid_desc["tensors"]:
        entry["handle"]["size_bytes"] += 4096
    validate_kv_description(valid_desc)
    with pytest.raises(KvShareError, match="bytes"):
        import_kv(valid_desc)


def test_missing_file_is_rejected(valid_desc: dict[str, Any]) -> None:
    for entry in valid_desc["tensors"]:
        entry["handle"]["name"] = "kvtier-kv-gone0000"
    with pytest.raises(KvShareError, match="does not exist"):
        import_kv(valid_desc)


def test_exact_fit_is_accepted(valid_desc: dict[str, Any]) -> None:
    # The second tensor ends exactly at the last byte of the file: valid.
    last = valid_desc["tensors"][1]
    assert (last["storage_offset"] + NUM_BLOCKS * 64) * 2 == last["handle"]["size_bytes"]
    tensors, _, closer = import_kv(valid_desc)
    del tensors
    closer()


def cuda_handle_desc() -> dict[str, Any]:
    return {
        "version": 1,
        "transport": "cuda_ipc",
        "num_blocks": 4,
        "tensors": [
            {
                "dtype": "float16",
                "shape": [4, 8],
                "stride": [8, 1],
                "storage_offset": 0,
                "block_dim": 0,
                "handle": {
                    "kind": "cuda_ipc",
                    "device": 0,
                    "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
                    "ipc_handle": b"\x02c" + bytes(64),
                    "storage_size_bytes": 64,
                    "storage_offset_bytes": 0,
                    "ref_counter_handle": b"/torch_123_456_0",
                    "ref_counter_offset": 0,
                    "event_handle": bytes(64),
                    "event_sync_required": True,
                },
            }
        ],
    }


def test_cuda_description_shape_is_valid_without_a_gpu() -> None:
    validate_kv_description(cuda_handle_desc())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_description_without_cuda_is_refused() -> None:
    with pytest.raises(KvShareError, match="no CUDA device"):
        import_kv(cuda_handle_desc())


HOSTILE_CUDA: dict[str, Callable[[dict[str, Any]], None]] = {
    "expandable segment handle": lambda h: h.update(ipc_handle=b"\x02e" + bytes(64)),
    "ref counter elsewhere": lambda h: h.update(ref_counter_handle=b"/etc/passwd"),
    "ref counter traversal": lambda h: h.update(ref_counter_handle=b"/torch_1_2_3/../../x"),
    "ref counter offset too big": lambda h: h.update(ref_counter_offset=10000),
    "short ipc handle": lambda h: h.update(ipc_handle=bytes(10)),
    "ipc handle as str": lambda h: h.update(ipc_handle="x" * 64),
    "short event handle": lambda h: h.update(event_handle=bytes(10)),
    "storage smaller than view": lambda h: h.update(storage_size_bytes=63),
    "negative storage offset": lambda h: h.update(storage_offset_bytes=-64),
    "event flag not bool": lambda h: h.update(event_sync_required=1),
    "bad device": lambda h: h.update(device=-1),
    "bad uuid": lambda h: h.update(device_uuid=5),
    "shm key in cuda handle": lambda h: h.update(name="kvtier-kv-x"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CUDA))
def test_hostile_cuda_handles_are_rejected(case: str) -> None:
    desc = cuda_handle_desc()
    HOSTILE_CUDA[case](desc["tensors"][0]["handle"])
    with pytest.raises(KvShareError):
        validate_kv_description(desc)


def test_expandable_segment_rejection_explains_the_fix() -> None:
    desc = cuda_handle_desc()
    desc["tensors"][0]["handle"]["ipc_handle"] = b"\x02e" + bytes(64)
    with pytest.raises(KvShareError, match="expandable_segments:False"):
        validate_kv_description(desc)


def test_tensors_on_two_gpus_are_rejected() -> None:
    desc = cuda_handle_desc()
    other = copy.deepcopy(desc["tensors"][0])
    other["handle"].update(device=1, device_uuid="GPU-11111111-1111-1111-1111-111111111111")
    desc["tensors"].append(other)
    with pytest.raises(KvShareError, match="one GPU"):
        validate_kv_description(desc)


def test_supported_dtypes_match_torch_sizes() -> None:
    for name, itemsize in SUPPORTED_DTYPES.items():
        dtype = getattr(torch, name, None)
        if dtype is not None:
            assert torch.empty(0, dtype=dtype).element_size() == itemsize, name


# -- CUDA IPC (needs a GPU) -------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_ipc_cross_process_every_byte(layout: str) -> None:
    run_cross_process(layout, "cuda:0")


@pytest.mark.cuda
@needs_cuda
def test_cuda_expandable_segments_are_refused_with_advice() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvtier.client.kv_share import KvShareError, export_kv
        kv = torch.empty([2, 64, 16, 8, 128], dtype=torch.float16, device="cuda")
        try:
            export_kv([kv], [1])
        except KvShareError as exc:
            assert "expandable_segments:False" in str(exc), exc
            print("refused")
        else:
            print("exported")
        """
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused"


@pytest.mark.cuda
@needs_cuda
def test_cuda_storage_larger_than_allocation_is_refused() -> None:
    engine = Engine("per_layer_block_dim_0", "cuda:0")
    try:
        desc = copy.deepcopy(engine.desc)
        entry = desc["tensors"][0]
        # Claim a far bigger storage and a view that reaches into it: the
        # description is self-consistent, but the allocation is not that big.
        entry["handle"]["storage_size_bytes"] = 2**40
        entry["shape"][1] = 2**20
        for other in desc["tensors"][1:]:
            other["handle"] = entry["handle"]
        with pytest.raises(KvShareError, match="allocation"):
            import_kv(desc)
    finally:
        engine.ask("check")
        engine.finish()


def test_share_in_place_entries_do_not_outlive_their_storage() -> None:
    # kv_share remembers shared storages by address; a private tensor that
    # later lands at a freed shared storage's address must not be described
    # as that file (the daemon would copy into the dead storage's memory).
    import torch

    from kvtier.client import kv_share

    shared = torch.zeros(4, 256)
    (name,) = kv_share.share_kv_in_place([shared])
    assert kv_share.export_kv([shared], [0])["tensors"][0]["handle"]["name"] == name
    private = torch.zeros(4, 256)
    stale = kv_share._SHARED[shared.untyped_storage().data_ptr()]
    with kv_share._SHARED_LOCK:  # what address reuse would look like
        kv_share._SHARED[private.untyped_storage().data_ptr()] = stale
    with pytest.raises(kv_share.KvShareError, match="shared memory"):
        kv_share.export_kv([private], [0])
    # Sharing it then gives it its own file.
    (fresh,) = kv_share.share_kv_in_place([private])
    assert fresh != name
    assert kv_share.export_kv([private], [0])["tensors"][0]["handle"]["name"] == fresh
    kv_share.unlink_shared_kv(private)
    kv_share.unlink_shared_kv(shared)
