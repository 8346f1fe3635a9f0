"""A Hydra plugin whose only job is to register edgekiln's typed schema.

`dvc exp run -S ...` composes conf/ through Hydra inside DVC's own process;
`.dvc/config` points DVC's `plugins_path` at `pipeline/`, Hydra scans this
`hydra_plugins` namespace package there, and importing this module registers
the schema, so DVC's composition rejects the same typos `python -m pipeline` does.
"""

from hydra.plugins.search_path_plugin import SearchPathPlugin

from pipeline.engine.schema import register

register()


class EdgekilnSchema(SearchPathPlugin):
    """Adds nothing to the search path; exists so Hydra imports this module."""

    def manipulate_search_path(self, search_path) -> None:
        return None
