"""docs/results.md is what bench/results_doc.py makes of bench/results/*.json, and no result is left out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "results_doc.py"
RESULTS = REPO / "bench" / "results"
DOC = REPO / "docs" / "results.md"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_committed_doc_is_current() -> None:
    done = run_script("--check")
    assert done.returncode == 0, f"{done.stderr}\nrun `python bench/results_doc.py` and commit docs/results.md"


# The results the renderers were written for: each must render through its renderer, not the generic
# fallback (a file added later by another change may fall back until it gets a renderer of its own).
RENDERED = [
    "chat-small-daemon-cpu.json", "disk-cpu.json", "gpu-NVIDIA-H100-80GB-HBM3.json",
    "gpu-qos-NVIDIA-H100-80GB-HBM3.json", "gpu-qos-restore-repeats-NVIDIA-H100-80GB-HBM3.json",
    "hostile-policy.json", "protocol-cpu.json", "remote-cpu.json", "replay-claude_code_even-sweep.json",
    "replay-claude_code_even.json", "replay-conversation.json", "replay-nodes-conversation.json",
    "replay-nodes-synthetic.json", "replay-synthetic.json", "restart-cpu.json", "session-oracle.json",
    "stress-churn.json", "stress-fuzz.json", "stress-hostile.json", "stress-load.json", "tiers-vm.json",
    "ttft-1b-daemon-cuda-2048-idle0.5.json", "ttft-200m-daemon-cpu.json", "vllm-busy-cpu.json", "vllm-cpu.json",
    "peers-cpu.json", "policy-cost-cpu.json", "protocol-restore-cpu.json", "protocol-restore-main-cpu.json",
    "protocol-restore-profile-cpu.json", "side-by-side.json", "upgrade-cpu.json", "vllm-gemma3-cpu.json",
    "vllm-llama-cpu.json", "vllm-mla-cpu.json", "vllm-nodaemon-cpu.json", "vllm-restore-cpu.json",
]


def test_every_result_has_a_section_and_renders_without_fallback(tmp_path: Path) -> None:
    done = run_script("--out", str(tmp_path / "results.md"), "--readme", str(tmp_path / "README.md"))
    assert done.returncode == 0, done.stderr
    for name in RENDERED:
        if (RESULTS / name).exists():
            assert name not in done.stderr, f"{name} fell back to a generic section:\n{done.stderr}"
    text = DOC.read_text()
    names = sorted(p.name for p in RESULTS.glob("*.json"))
    assert names, "bench/results holds no JSON"
    for name in names:
        assert f"`bench/results/{name}`" in text, f"{name} has no section in docs/results.md"


def test_check_fails_on_stale_doc_and_new_file_gets_generic_section(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for p in RESULTS.glob("*.json"):
        (results / p.name).write_text(p.read_text())
    out = tmp_path / "results.md"
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    args = ("--results", str(results), "--out", str(out), "--readme", str(readme))
    assert run_script(*args).returncode == 0
    assert run_script(*args, "--check").returncode == 0
    # A result no renderer knows, as another branch would add it: it must appear, numbers and all.
    (results / "newbench-cpu.json").write_text(json.dumps({"ratio_vs_alone": 0.8125, "passed": True,
                                                         "machine": {"cpu_count": 2}}))
    stale = run_script(*args, "--check")
    assert stale.returncode == 1 and "stale" in stale.stderr
    assert run_script(*args).returncode == 0
    text = out.read_text()
    assert "`bench/results/newbench-cpu.json`" in text and "0.8125" in text and "No renderer matches" in text
    # A file a renderer's pattern matches but whose shape it cannot read: a generic section and a warning.
    (results / "stress-fuzz-small.json").write_text(json.dumps({"cases_total": 77}))
    done = run_script(*args)
    assert done.returncode == 0 and "cannot read stress-fuzz-small.json" in done.stderr
    assert "`bench/results/stress-fuzz-small.json`" in out.read_text()


def test_a_number_changed_in_json_changes_the_doc(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    src = json.loads((RESULTS / "tiers-vm.json").read_text())
    src["memory"]["results"]["kvtier"]["rss_bytes_per_block"] = 123.0
    (results / "tiers-vm.json").write_text(json.dumps(src))
    out = tmp_path / "results.md"
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    # The README's restart row reads restart-cpu.json: a changed number there moves the README too.
    restart = json.loads((RESULTS / "restart-cpu.json").read_text())
    restart["standby"]["served"] = 2047  # the row quotes the standby's take-over (bench/restart.py)
    (results / "restart-cpu.json").write_text(json.dumps(restart))
    assert run_script("--results", str(results), "--out", str(out), "--readme", str(readme)).returncode == 0
    assert "**123**" in out.read_text()
    assert "2047/2048 blocks byte-exact" in readme.read_text()
    assert "2047/2048" not in (REPO / "README.md").read_text()


def test_readme_is_for_users_and_short() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md is over 300 lines: move detail into docs/"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    assert "python bench/results_doc.py" in text
    for anchor in re.findall(r"docs/results\.md#([\w-]+)", text):
        assert f'<a id="{anchor}"></a>' in DOC.read_text(), f"README links to a missing section #{anchor}"
