"""Time stamps inside vLLM's processes, and one request's TTFT cut at them (bench/vllm.py, bench/peers.py).

Contract
========

- ``install_trace(worker, connector)``: run in vLLM's worker through
  ``LLM.collective_rpc`` (the child calls ``cloudpickle.register_pickle_by_value``
  on this module first, so the worker needs no import of it). Wraps the worker's
  ``execute_model`` ("exec", tokens scheduled), ``sample_tokens`` ("sample"), the
  model's ``forward`` ("model") and, with a KV connector, its loads ("load") and
  stores ("save"): for ``connector="kvtier"`` the worker half's ``start_load_kv``
  (count: blocks loaded) and ``wait_for_save``; for any other connector the
  connector object's own ``start_load_kv`` / ``wait_for_save`` (count None). Each
  call appends ``(name, start, end, count)`` (CLOCK_MONOTONIC, shared by every
  process) to the worker's list (``kvtier.testing.vllm_trace``; a few us a call);
  nothing else changes. Returns ``{"pid", "connector"}``.
- ``kvtier_worker_stats(worker)``: KvtierConnector's worker counters
  (``blocks_loaded``, ``blocks_stored``, ``load_s``).
- ``scheduler_hook(folder, events_path)``: KvtierConnector's scheduler half lives in
  vLLM's EngineCore process, which vLLM spawns; this writes a ``sitecustomize.py``
  into ``folder`` that wraps ``SchedulerSide``'s ``on_new_request`` ("new"),
  lookup completion ("lookup_done"), ``get_num_new_matched_tokens`` ("gnmt",
  count: its answer) and ``update_state_after_alloc`` ("alloc"), one JSON line
  each appended to ``events_path``. Returns the folder to put first on the
  engine's ``PYTHONPATH`` and the variables to add (``BENCH_VLLM_SCHED_EVENTS``).
- ``breakdown(t_submit, t_first, events)``: one request's TTFT (ms) cut at the
  events: submit -> the forward step (the first ``exec`` that scheduled tokens),
  the forward step (``execute_model`` + ``sample_tokens``), the model's forward
  alone, the connector's loads before the forward step ends (``load_ms``; those
  inside the step: ``load_in_forward_ms``) and stores inside it (``save_ms``),
  and, with the scheduler events, arrival -> the lookup's answer and the rest.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

Event = tuple[Any, ...]


def install_trace(worker: Any, connector: str | None) -> dict[str, Any]:
    from functools import partial

    from kvtier.testing.vllm_trace import timed as _timed, trace_events

    timed = partial(_timed, trace_events(worker))
    # Instance attributes win over WorkerWrapperBase's methods / __getattr__ in run_method's getattr.
    worker.execute_model = timed("exec", worker.execute_model, lambda so, *_: int(so.total_num_scheduled_tokens))
    worker.sample_tokens = timed("sample", worker.sample_tokens)
    model = worker.worker.model_runner.model
    model.forward = timed("model", model.forward)  # nn.Module.__call__ finds the instance attribute
    info: dict[str, Any] = {"pid": os.getpid(), "connector": connector}
    if not connector:
        return info
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    if connector == "kvtier":
        side = group._worker
        side.start_load_kv = timed("load", side.start_load_kv, lambda meta: sum(len(x.keys) for x in meta.loads))
        side.wait_for_save = timed("save", side.wait_for_save)
    else:  # the model runner calls these on the connector object get_kv_transfer_group() returns
        group.start_load_kv = timed("load", group.start_load_kv)
        group.wait_for_save = timed("save", group.wait_for_save)
    return info


def kvtier_worker_stats(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    layers = side._layers  # layer_overlap: what went beside the forward, and how long the forward waited for it
    return {"blocks_loaded": side.blocks_loaded, "blocks_stored": side.blocks_stored, "load_s": side.load_s,
            "blocks_loaded_by_layer": side.blocks_loaded_by_layer,
            "layer_wait_s": layers.wait_s if layers is not None else 0.0}


def _patch_scheduler_side(path: str) -> None:
    """The body of the ``sitecustomize`` that ``scheduler_hook`` writes (its source is copied there): wraps
    SchedulerSide at the class, before vLLM builds it; each event is one line appended to ``path``."""
    import json
    import os
    import time as _t

    from kvtier.integrations.vllm.scheduler import SchedulerSide

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def emit(*ev: Any) -> None:
        os.write(fd, (json.dumps(ev) + "\n").encode())

    on_new, gnmt, alloc = (SchedulerSide.on_new_request, SchedulerSide.get_num_new_matched_tokens,
                           SchedulerSide.update_state_after_alloc)

    def on_new_request(self: Any, request: Any) -> None:
        t0 = _t.monotonic()
        on_new(self, request)
        emit("new", t0, _t.monotonic(), os.getpid())
        t = self._tracked.get(request.request_id)
        if t is not None and t.lookup is not None:
            t.lookup.add_done_callback(lambda _f: emit("lookup_done", _t.monotonic(), None, None))

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        t0 = _t.monotonic()
        out = gnmt(self, request, num_computed_tokens)
        emit("gnmt", t0, _t.monotonic(), out[0])
        return out

    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        t0 = _t.monotonic()
        alloc(self, request, blocks, num_external_tokens)
        emit("alloc", t0, _t.monotonic(), num_external_tokens)

    SchedulerSide.on_new_request = on_new_request  # type: ignore[method-assign]
    SchedulerSide.get_num_new_matched_tokens = get_num_new_matched_tokens  # type: ignore[method-assign]
    SchedulerSide.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]


def scheduler_hook(folder: Path, events_path: Path) -> tuple[str, dict[str, str]]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "# bench: time stamps of KvtierConnector's scheduler half (bench/vllm_timing.py)\nfrom typing import Any\n\n"
        + inspect.getsource(_patch_scheduler_side)
        + "\n\nimport os as _os\nif _os.environ.get('BENCH_VLLM_SCHED_EVENTS'):\n"
        "    _patch_scheduler_side(_os.environ['BENCH_VLLM_SCHED_EVENTS'])\n")
    events_path.touch()
    return str(folder), {"BENCH_VLLM_SCHED_EVENTS": str(events_path)}


def breakdown(t_submit: float, t_first: float, events: list[Event]) -> dict[str, Any]:
    """One request's TTFT cut at the time stamps (ms). All on CLOCK_MONOTONIC, shared by the processes."""
    ms = lambda a, b: round(1e3 * (b - a), 3)  # noqa: E731
    execs = [e for e in events if e[0] == "exec"]
    fwd = next((e for e in execs if e[3]), None)
    out: dict[str, Any] = {"ttft_ms": ms(t_submit, t_first), "engine_steps": len(execs)}
    if fwd is None:
        return out
    samples = [e for e in events if e[0] == "sample" and e[1] >= fwd[1]]
    fwd_end = samples[0][2] if samples else fwd[2]
    out |= {"empty_steps_before_forward": sum(1 for e in execs if not e[3] and e[1] < fwd[1]),
            "submit_to_first_step_ms": ms(t_submit, execs[0][1]),
            "submit_to_forward_ms": ms(t_submit, fwd[1]),
            "forward_step_ms": ms(fwd[1], fwd_end),  # execute_model + sample_tokens (a synchronous load runs inside)
            "forward_tokens": fwd[3],
            "after_forward_ms": ms(fwd_end, t_first)}  # engine output, IPC, front end
    model = next((e for e in events if e[0] == "model" and e[1] >= fwd[1]), None)
    if model is not None:
        out["model_forward_ms"] = ms(model[1], model[2])  # the model's forward alone (attention, MLP)
    # A connector's loads up to the end of the forward step: kvtier counts blocks (0: nothing to load);
    # other connectors' calls carry no count, and an empty one takes microseconds.
    loads = [e for e in events if e[0] == "load" and e[3] != 0 and e[1] < fwd_end]
    if loads:
        inside = [e for e in loads if e[1] >= fwd[1]]
        out["load_ms"] = round(sum(1e3 * (e[2] - e[1]) for e in loads), 3)
        out["load_in_forward_ms"] = round(sum(1e3 * (e[2] - e[1]) for e in inside), 3)
        if any(isinstance(e[3], int) for e in loads):
            out["load_blocks"] = sum(e[3] for e in loads if isinstance(e[3], int))
        out["forward_without_load_ms"] = round(out["forward_step_ms"] - out["load_in_forward_ms"], 3)
    saves = [e for e in events if e[0] == "save" and fwd[1] <= e[1] < fwd_end]
    if saves:
        out["save_ms"] = round(sum(1e3 * (e[2] - e[1]) for e in saves), 3)
    new = next((e for e in events if e[0] == "new"), None)
    if new is None:
        return out
    answer = next((e for e in events if e[0] == "gnmt" and e[3] is not None), None)
    done = next((e for e in events if e[0] == "lookup_done"), None)
    out |= {"submit_to_on_new_request_ms": ms(t_submit, new[1]),
            "gnmt_calls": sum(1 for e in events if e[0] == "gnmt"),
            "gnmt_us_total": round(1e6 * sum(e[2] - e[1] for e in events if e[0] == "gnmt"), 1)}
    if done is not None:
        out["lookup_round_trip_ms"] = ms(new[1], done[1])  # on_new_request -> kvtierd's answer landed
    if answer is not None:
        out["matched_tokens"] = answer[3]
        out["on_new_request_to_answer_ms"] = ms(new[1], answer[2])
        out["arrival_to_answer_ms"] = ms(t_submit, answer[2])  # submit -> the scheduler has the answer
    # The first load after the answer, in the forward step or (a hybrid model's, loaded asynchronously) in an
    # empty step before it.
    first_load = next((e for e in loads if answer is not None and e[1] >= answer[2]), None)
    if first_load is not None and answer is not None:
        out["answer_to_load_start_ms"] = ms(answer[2], first_load[1])  # alloc, schedule, meta, dispatch
    if "arrival_to_answer_ms" in out and "load_ms" in out:
        out["rest_ms"] = round(out["ttft_ms"] - out["arrival_to_answer_ms"] - out["load_ms"], 3)
    return out
