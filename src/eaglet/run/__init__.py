"""`eaglet run` / `eaglet demo`: the run's YAML (``run_config``), its stages as data (``stage_kinds``), what they will
cost (``plan``) and running them in order with skip and resume (``pipeline``)."""

from .pipeline import Pipeline
from .run_config import RunConfig, load_run_config

__all__ = ["Pipeline", "RunConfig", "load_run_config"]
