"""The run's clock across resumes: a callback that times every segment of a run (wall time, and training time
without evaluations and saves) and saves the whole run's clock (`RunClock`) in each checkpoint's trainer state."""

import time
from dataclasses import asdict

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..run_records import RUN_CLOCK, RunClock


class RunClockCallback(TrainerCallback, ExportableState):
    """Keeps the run's clock (`RunClock`: wall and training time over every segment of a resumed run), which each
    checkpoint's `trainer_state.json` saves among its stateful callbacks, under `RUN_CLOCK`, and which the next
    segment reads back (whatever `--restore-callback-states-from-checkpoint` says); at the end of training it is in
    `state.stateful_callbacks[RUN_CLOCK]`. Training time is the time of the steps and logs: each evaluation and save
    closes the window at the end of the latest step, and the next window starts when it is done."""

    def __init__(self):
        self._since = 0.0  # the clock where the current training window began
        self._step_end = 0.0  # ... at the end of the latest step
        self._began: float | None = None  # ... when this segment's training began
        self._last_event = 0.0  # ... at the end of its latest step, log, evaluation or save
        self._ended: float | None = None  # ... at the end of its training: the end of its last step's save
        self._training_seconds = 0.0  # of this segment's closed windows
        self.recorded_clock: RunClock | None = RunClock()  # of the segments before this one; None: unknown

    def _event(self) -> float:
        self._last_event = time.perf_counter()
        return self._last_event

    def _close_window(self, until: float) -> None:
        """Count the current window, up to `until`, as training time."""
        self._training_seconds += max(until - self._since, 0.0)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.recorded_clock = RunClock()
        elif (earlier := RunClock.recorded(vars(state))) is not None:  # resumed: add to the checkpoint's clock
            starts = [*earlier.segment_starts, state.global_step]
            self.recorded_clock = RunClock(starts, earlier.wall_seconds, earlier.training_seconds)
        else:  # resumed from a checkpoint that recorded no clock: the time before it is unknown
            self.recorded_clock = None
        self._since = self._began = self._step_end = self._last_event = time.perf_counter()
        self._ended, self._training_seconds = None, 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self._step_end = self._event()

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_window(self._step_end)  # the steps before the evaluation are training time, it is not
        self._since = self._event()

    def on_save(self, args, state, control, **kwargs):
        self._close_window(self._step_end)
        self._since = self._event()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "loss" in logs:
            now = self._event()
            self._close_window(now)
            self._since = now

    def on_train_end(self, args, state, control, **kwargs):
        self._close_window(self._step_end)  # the steps after the last log count; the final save does not
        self._ended = self._last_event  # not what other callbacks do at the end (the picture, say)
        state.stateful_callbacks[RUN_CLOCK] = self.state()

    def run_clock(self) -> RunClock | None:
        """The run's clock so far: the segments before this one and this one up to now (or its end)."""
        earlier = self.recorded_clock
        if earlier is None or self._began is None:
            return earlier
        pending = max(self._step_end - self._since, 0.0)  # the window still open, up to the latest step
        wall = (self._ended or time.perf_counter()) - self._began
        training = self._training_seconds + (0.0 if self._ended else pending)
        return RunClock(earlier.segment_starts, earlier.wall_seconds + wall, earlier.training_seconds + training)

    def state(self) -> dict:
        """What a checkpoint saves (`ExportableState`): the run's clock up to the save."""
        clock = self.run_clock()
        return {"args": {}, "attributes": {"recorded_clock": asdict(clock) if clock else None}}
