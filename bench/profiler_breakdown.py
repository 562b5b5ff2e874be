"""Workload 6, where profiling's cost goes: the engine's part and each handler's.

`profiler_overhead` says what a profile costs; this says what that cost is made of, so that
a missed target comes with the profile that shows what bounds it. For each program it is
given sizes for (the suite gives the small ones, where a profile costs most), five variants
run interleaved, repeat by repeat:

- plain;
- profiled (`cad.profile()`);
- profiled with the recorder's handlers idle: the engine still announces every event to the
  recorder and does what it does only for a listener (origin lines, buffers made for the
  profiler, the calls themselves), but the handlers return at once. Its ratio to plain is the
  engine's part of the cost; profiled less this is the handlers' part;
- the same, also without origin lines (the stack walk that finds each saving entry's user
  line), and the same, also with replayed loop steps making no buffers for the profiler
  (their saved arrays are kept, as unprofiled): what those two parts of the engine's cost
  weigh. Both leave the profile wrong; they are timed, never read.

A separate pass then times each handler where it runs, inside the program (a timer around
every call; the timer's own cost, measured on an empty handler, is taken off): calls per run
and microseconds per call. These are diagnostics of the recorder's internals, not API: they
swap the recorder class that `profile()` builds for a subclass while they run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

from .profiler_overhead import PROGRAMS, interleaved, variant_rows

VARIANTS = ("plain", "profiled", "profiled, handlers idle",
            "handlers idle, no origin lines", "handlers idle, replayed steps make no buffers")


def _nothing(*_: Any) -> None:
    return None


@contextmanager
def _recorder_class(make: Callable[[type], type]) -> Iterator[None]:
    """`profile()` builds `make(recorder class)` instead of the recorder while the block runs."""
    from checkpoint_ad.profiler import recorder

    real = recorder._Recorder
    recorder._Recorder = make(real)  # type: ignore[misc]
    try:
        yield
    finally:
        recorder._Recorder = real  # type: ignore[misc]


@contextmanager
def _no_origin_lines() -> Iterator[None]:
    """Entries find no user line (`tape._user_frame`, the stack walk, answers at once)."""
    from checkpoint_ad import tape
    from checkpoint_ad.origins import NO_ORIGIN

    real = tape._user_frame
    tape._user_frame = lambda: NO_ORIGIN
    try:
        yield
    finally:
        tape._user_frame = real


@contextmanager
def _no_step_buffers() -> Iterator[None]:
    """A replayed step heard by a profiler keeps its arrays as an unheard one does, making
    no buffers for the profiler to watch (`step_tape.tape_kept` as `tape_as_is`)."""
    from checkpoint_ad.strategies.loops import step_tape

    real = step_tape.tape_kept
    step_tape.tape_kept = lambda program, carry, x, *_: step_tape.tape_as_is(program, carry, x)
    try:
        yield
    finally:
        step_tape.tape_kept = real


def _idle(real: type) -> type:
    class Idle(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.handlers = {kind: _nothing for kind in self.handlers}

    return Idle


def _handler_names(real: type) -> list[str]:
    """The recorder's methods that run inside the program: one per event it hears, and the
    callback of a watched buffer's death."""
    from checkpoint_ad.profiler.records import Profile

    recorder = real(Profile(), "cpu", False)
    return sorted({fn.__name__ for fn in recorder.handlers.values()} | {"_free"})


def _kept_path(entry: Any, buffer: Any, fresh: bool, *_: Any) -> str:
    """Which of `_Recorder._kept`'s paths an entry of `record`'s fast path takes."""
    if buffer is None:
        return "_kept: saved slots" if entry._saved else "_kept: saves nothing"
    return "_kept: new buffer" if fresh else "_kept: buffer saved again"


def _timing(name: str, method: Callable[..., Any], spent: dict[str, list[Any]],
            depth: list[int]) -> Callable[..., Any]:
    """`method`, tallying its calls and seconds into ``spent[name]`` (`_kept`'s, per path),
    unless another timed method called it (`depth`: `_record` called by `_kept` counts in
    `_kept`'s time only)."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return method(self, *args, **kwargs)
        depth[0] = 1
        start = perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            seconds = perf_counter() - start
            depth[0] = 0
            tally = spent.setdefault(_kept_path(*args) if name == "_kept" else name, [0, 0.0])
            tally[0] += 1
            tally[1] += seconds

    return run


def _timed_class(spent: dict[str, list[Any]]) -> Callable[[type], type]:
    """A recorder whose handlers tally their calls and seconds into `spent`."""
    depth = [0]

    def make(real: type) -> type:
        return type("Timed", (real,), {name: _timing(name, getattr(real, name), spent, depth)
                                       for name in _handler_names(real)})

    return make


def _timer_cost(calls: int = 200_000) -> float:
    """Seconds the timing wrapper adds per call, measured around an empty method."""
    run = _timing("empty", _nothing, {}, [0])
    began = perf_counter()
    for _ in range(calls):
        run(None, None)
    bare = perf_counter()
    for _ in range(calls):
        _nothing(None, None)
    return max((bare - began) - (perf_counter() - bare), 0.0) / calls


def breakdown(params: dict, threads: int) -> dict[str, Any]:
    """Per program: one row per variant (median seconds, ratio to plain), the handlers' table
    in the profiled row's extras."""
    import checkpoint_ad as cad

    rows = []
    timer = _timer_cost()
    for program, make in PROGRAMS.items():
        if program not in params:
            continue
        sizes = params[program]
        step, _ = make(sizes)

        def profiled(step: Callable[[], None] = step) -> None:
            with cad.profile():
                step()

        def idle(step: Callable[[], None] = step) -> None:
            with _recorder_class(_idle), cad.profile():
                step()

        def no_origins(step: Callable[[], None] = step) -> None:
            with _recorder_class(_idle), _no_origin_lines(), cad.profile():
                step()

        def no_step_buffers(step: Callable[[], None] = step) -> None:
            with _recorder_class(_idle), _no_step_buffers(), cad.profile():
                step()

        times = interleaved(
            dict(zip(VARIANTS, (step, profiled, idle, no_origins, no_step_buffers))),
            params["repeats"])
        spent: dict[str, list[float]] = {}
        with _recorder_class(_timed_class(spent)):
            for _ in range(params["repeats"]):
                profiled()
        handlers = {
            name: {"calls_per_run": calls / params["repeats"],
                   "us_each": max(seconds / calls - timer, 0.0) * 1e6,
                   "ms_per_run": max(seconds - calls * timer, 0.0) / params["repeats"] * 1e3}
            for name, (calls, seconds) in sorted(spent.items()) if calls}
        program_rows = variant_rows(program, times, {"breakdown": True, **sizes})
        for row in program_rows:
            if row["extras"]["variant"] == "profiled":
                row["extras"].update(handlers=handlers, timer_us=timer * 1e6)
        rows.extend(program_rows)
    return {"rows": rows}
