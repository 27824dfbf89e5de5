"""Moved to `jetflow_pl.runtime.contract` (the runtime owns the engine-directory contract; stages import
the library, never the reverse). This name stays only until the last importer is switched; import
`jetflow_pl.runtime.contract` instead."""

from jetflow_pl.runtime.contract import *  # noqa: F403
from jetflow_pl.runtime.contract import (  # noqa: F401  (the names importers use today)
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    TREE_ATTENTION_DOMAIN,
    TREE_ATTENTION_OP,
)
