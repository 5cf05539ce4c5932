"""Moved to `localrun.formats`. Re-exported here until the last importers move:
localrun/store.py and localrun/server/describe.py."""

from __future__ import annotations

from localrun.formats import FILE_TYPE_NAMES, file_type_name  # noqa: F401 - re-exports
