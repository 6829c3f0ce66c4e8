"""``kvtier arenas``: list and remove the persistent CPU tiers daemons leave in arena_dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.tiers.persistent_arena import ArenaDirectory
from kvtier.tools.cli import main

LAYOUT = {"mode": "store", "block_size": 4, "block_bytes": 512, "dtype": "bfloat16", "hash_algo": "xxh3_128"}
A = "ipc:///run/kvtier-0/kvtierd.sock"
B = "ipc:///run/kvtier-1/kvtierd.sock"


def make(where: Path, endpoint: str, pool: str, *, keep_open: bool = False):  # type: ignore[no-untyped-def]
    arena = ArenaDirectory(where, endpoint).open(pool, LAYOUT, 16, 512, pin=False)
    if not keep_open:
        arena.close()  # what a stopped daemon leaves: the files, no lock
    return arena


def test_list_shows_each_arena_and_whether_a_daemon_holds_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    held = make(tmp_path, A, "llama", keep_open=True)
    make(tmp_path, B, "qwen")
    assert main(["arenas", "--arena-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "in use" in out and "qwen" in out and "waiting" in out and "2 arenas" in out
    assert main(["arenas", "list", "--arena-dir", str(tmp_path), "--json"]) == 0
    rows = {r["pool"]: r for r in json.loads(capsys.readouterr().out)["arenas"]}
    assert rows["llama"]["held"] and rows["qwen"]["socket"] == B and rows["qwen"]["blocks"] == 16
    held.close()


def test_remove_takes_one_daemons_free_arenas_and_never_a_held_one(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    held = make(tmp_path, A, "llama", keep_open=True)
    make(tmp_path, A, "small")
    make(tmp_path, B, "qwen")
    monkeypatch.setenv("KVTIER_SOCKET", A)  # as a unit's ExecStopPost has it
    assert main(["arenas", "remove", "--arena-dir", str(tmp_path), "--dry-run"]) == 1  # llama is held
    assert len(list(tmp_path.glob("*.index"))) == 3
    assert main(["arenas", "remove", "--arena-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "removed 'small'" in captured.out and "'llama'" in captured.err and "stop it first" in captured.err
    held.close()
    assert main(["arenas", "remove", "--arena-dir", str(tmp_path), "--pool", "llama"]) == 0
    assert main(["arenas", "remove", "--arena-dir", str(tmp_path), "--all"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert main(["arenas", "remove", "--arena-dir", str(tmp_path), "--all"]) == 0
    assert "no arenas to remove" in capsys.readouterr().out


def test_bad_use_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a directory"):
        main(["arenas", "--arena-dir", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="go with 'remove'"):
        main(["arenas", "--arena-dir", str(tmp_path), "--all"])
    with pytest.raises(SystemExit, match="not both"):
        main(["arenas", "remove", "--arena-dir", str(tmp_path), "--all", "--socket", A])


def test_the_command_loads_no_torch() -> None:
    code = ("import sys\nfrom kvtier.tools.cli import main\nmain(['arenas', '--json'])\n"
            "print(sorted(n for n in sys.modules if n == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().endswith("[]"), out.stdout
