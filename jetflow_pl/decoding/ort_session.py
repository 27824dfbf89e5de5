"""Moved to `jetflow_pl.runtime.ort_session`; this name stays only until the last importer is switched."""

from jetflow_pl.runtime.ort_session import *  # noqa: F403
from jetflow_pl.runtime.ort_session import make_session  # noqa: F401
