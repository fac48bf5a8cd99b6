"""Short torch.profiler windows and the phase ranges that label what happens inside them.

One `torch.profiler.profile` lives for the whole run, driven by `step()` at every iteration
end, with an explicit schedule: nothing for `skip` iterations, then every `every`
iterations `warmup` + `active` profiled ones (torch's schedule(wait, warmup, active) with
the wait moved after the window, so the first window follows warm-up directly). Outside
windows the profiler is idle (ProfilerAction.NONE: no collection, no ranges entered).

At the end of each window the events are turned into trace_map Events and mapped at once;
the profiler's buffer is dropped with the window, so memory is bounded by one window.
"""
from __future__ import annotations

from typing import Callable, List

from .settings import Windows
from .trace_map import Event

_MAX_EVENTS = 3_000_000  # a window this large is skipped rather than mapped


class WindowSchedule:
    """A torch.profiler schedule callable: step -> ProfilerAction."""

    def __init__(self, w: Windows):
        from torch.profiler import ProfilerAction
        self.w = w
        self.A = ProfilerAction

    def __call__(self, step: int):
        w, A = self.w, self.A
        if not w.enabled or step < w.skip:
            return A.NONE
        window, pos = divmod(step - w.skip, w.every)
        if window >= w.repeat:
            return A.NONE
        if pos < w.warmup:
            return A.WARMUP
        if pos < w.warmup + w.active - 1:
            return A.RECORD
        if pos == w.warmup + w.active - 1:
            return A.RECORD_AND_SAVE
        return A.NONE

    def profiled(self, step: int) -> bool:
        return self(step) != self.A.NONE

    def recording(self, step: int) -> bool:
        return self(step) in (self.A.RECORD, self.A.RECORD_AND_SAVE)


_SKIP = {"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
         "profiler::_record_function_enter_new", "profiler::_record_function_exit",
         "aten::is_leaf", "aten::output_nr", "aten::_version"}


def extract_events(result, device_type: str = "cpu") -> List[Event]:
    """trace_map Events straight from a kineto result (`prof.profiler.kineto_results`).

    torch's own EventList (prof.events()) converts every field of every event in Python,
    about 0.1 ms per event; here only names, times and autograd numbers are read up front
    (shapes lazily, for the events a rule looks at), and nesting is rebuilt per thread from
    the time intervals as torch does. On a GPU each op gets the summed time of the kernels
    linked to it (kineto's linked correlation id), then its descendants' (device_time_total).
    """
    from torch.autograd import DeviceType
    cpu, kernel_us = [], {}
    for k in result.events():
        if k.device_type() != DeviceType.CPU:
            if device_type == "cuda":
                corr = k.linked_correlation_id()
                kernel_us[corr] = kernel_us.get(corr, 0.0) + k.duration_ns() / 1000.0
            continue
        if k.linked_correlation_id() > 0:
            continue  # a runtime call (cudaLaunchKernel ...) made by an op: part of its time
        if k.name() in _SKIP:
            continue
        cpu.append(k)
    rows = sorted(((k.start_ns(), -k.end_ns(), i, k) for i, k in enumerate(cpu)),
                  key=lambda r: (r[0], r[1], r[2]))
    out: List[Event] = []
    stacks = {}
    for idx, (start, neg_end, _, k) in enumerate(rows):
        thread = k.start_thread_id()
        # Async events (gloo's collectives run on its worker threads) nest in nothing.
        nested = not k.is_async() and thread == k.end_thread_id()
        stack = stacks.setdefault(thread, [])
        while nested and stack and stack[-1][1] < -neg_end:
            stack.pop()  # ends before this one does: not an ancestor
        parent = stack[-1][0] if (nested and stack) else None
        e = Event(id=idx, name=k.name(), parent=parent, thread=thread, start=start / 1000.0,
                  dur=(-neg_end - start) / 1000.0, seq=k.sequence_nr(),
                  fwd_thread=k.fwd_thread_id(), raw=k)
        if kernel_us:
            e.device = kernel_us.get(k.correlation_id(), 0.0)
        out.append(e)
        if nested:
            stack.append((idx, -neg_end))
    if kernel_us:
        for e in reversed(out):  # children come after their parent in start order
            if e.parent is not None:
                out[e.parent].device += e.device
    return out


class Windowed:
    """The run-long profiler. `on_window(events, iterations)` gets each finished window.
    Phase ranges are entered by the session (`neox_perf::<phase>`) only while `active`."""

    def __init__(self, windows: Windows, device_type: str,
                 on_window: Callable[[List[Event], List[int]], None]):
        import torch
        from torch.profiler import ProfilerActivity, profile
        self.schedule = WindowSchedule(windows)
        self.on_window = on_window
        self.device_type = device_type
        self.step_index = 0  # the iteration in progress
        self.window_iterations: List[int] = []
        self.notes: List[str] = []
        self._closing = False
        activities = [ProfilerActivity.CPU]
        if device_type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # torch's schedule reads our iteration index, not torch's own step count, so the
        # iterations between windows need no prof.step() (iteration_done)
        self.prof = profile(activities=activities,
                            schedule=lambda _torch_step: self.schedule(self.step_index),
                            on_trace_ready=self._ready, record_shapes=True,
                            profile_memory=False, with_stack=False, with_flops=False)
        self.prof.start()

    @property
    def active(self) -> bool:
        """True while the iteration in progress is being profiled (ranges worth entering)."""
        return self.schedule.profiled(self.step_index)

    def iteration_done(self) -> None:
        if self.schedule.recording(self.step_index):
            self.window_iterations.append(self.step_index)
        # Between windows torch's step would only close and reopen its step range: skipped, it
        # is not the hook's own cost at every iteration boundary of a run.
        idle = not (self.schedule.profiled(self.step_index)
                    or self.schedule.profiled(self.step_index + 1))
        self.step_index += 1
        if not idle:
            self.prof.step()

    def _ready(self, prof) -> None:
        iterations, self.window_iterations = self.window_iterations, []
        if self._closing:
            return
        result = getattr(prof.profiler, "kineto_results", None)
        if result is None:
            return
        events = extract_events(result, self.device_type)
        if len(events) > _MAX_EVENTS:
            self.notes.append(f"a window of {len(events)} events was dropped unmapped "
                              f"(limit {_MAX_EVENTS}); use fewer active iterations")
            return
        self.on_window(events, iterations)

    def close(self) -> None:
        """Stop; a window cut short by the end of the run is dropped, not mapped."""
        self._closing = True
        try:
            self.prof.stop()
        finally:
            self.prof = None
