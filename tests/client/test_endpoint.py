"""kvtier.client.endpoint: the one parser of ``ipc://`` endpoints, and the check of any endpoint."""

from __future__ import annotations

import pytest

from kvtier.client.endpoint import (
    MAX_IPC_PATH_BYTES,
    EndpointError,
    IpcAddress,
    check_endpoint,
    ipc_socket_file,
    parse_ipc,
)


@pytest.mark.parametrize(("endpoint", "want"), [
    ("ipc:///run/kvtier/kvtierd.sock", IpcAddress(path="/run/kvtier/kvtierd.sock", name=None)),
    ("ipc://@kvtierd", IpcAddress(path=None, name="kvtierd")),
    ("ipc://@a/b@c", IpcAddress(path=None, name="a/b@c")),  # an abstract name is any bytes
    ("ipc:///" + "x" * (MAX_IPC_PATH_BYTES - 1), IpcAddress(path="/" + "x" * (MAX_IPC_PATH_BYTES - 1), name=None)),
    ("tcp://127.0.0.1:5555", None),
    ("http://h:1", None),
    ("", None),
])
def test_parse_ipc_gives_the_address_or_none_for_other_schemes(endpoint: str, want: IpcAddress | None) -> None:
    assert parse_ipc(endpoint) == want
    assert ipc_socket_file(endpoint) == (want.path if want is not None else None)
    if want is not None:
        check_endpoint(endpoint)  # every ipc:// form parse_ipc takes is one kvtierd binds


@pytest.mark.parametrize(("endpoint", "says"), [
    ("ipc://", "absolute path after ipc://"),
    ("ipc://relative/kvtierd.sock", "absolute path after ipc://"),
    ("ipc://@", "name after '@'"),
    ("ipc:///run/kvtier/", "names a directory"),
    ("ipc:///" + "x" * MAX_IPC_PATH_BYTES, f"{MAX_IPC_PATH_BYTES + 1} bytes, the limit is {MAX_IPC_PATH_BYTES}"),
    ("ipc:///" + "é" * 54, "109 bytes"),  # the limit counts bytes, not characters
])
def test_a_malformed_ipc_endpoint_raises_saying_what_is_wrong(endpoint: str, says: str) -> None:
    for parse in (parse_ipc, ipc_socket_file, check_endpoint):
        with pytest.raises(EndpointError, match=says) as info:
            parse(endpoint)
        assert isinstance(info.value, ValueError)
        assert repr(endpoint) in str(info.value)  # the message names what it refused


@pytest.mark.parametrize(("endpoint", "says"), [
    ("tcp://host", "tcp://HOST:PORT"),
    ("tcp://host:0", "PORT in 1..65535"),
    ("tcp://host:70000", "PORT in 1..65535"),
    ("tcp://:5555", "tcp://HOST:PORT"),
    ("http://h:1", "ipc:// or tcp://"),
    ("kvtierd.sock", "ipc:// or tcp://"),
    (5, "expected an endpoint like"),
])
def test_check_endpoint_refuses_what_no_kvtierd_binds(endpoint: object, says: str) -> None:
    with pytest.raises(EndpointError, match=says):
        check_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://[::1]:1", "tcp://*:65535", "tcp://kv-1.local:80"])
def test_check_endpoint_takes_tcp_host_port(endpoint: str) -> None:
    check_endpoint(endpoint)
    assert parse_ipc(endpoint) is None and ipc_socket_file(endpoint) is None


def test_abstract_sockets_have_no_file() -> None:
    address = parse_ipc("ipc://@kvtierd")
    assert address is not None and address.abstract and address.path is None
    address = parse_ipc("ipc:///tmp/k.sock")
    assert address is not None and not address.abstract
