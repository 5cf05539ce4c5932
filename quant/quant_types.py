"""Moved to `localrun.formats` (the runtime reads these tables; quant/ only writes files
of these types). Re-exported here until the last importers move: quant/selector.py,
localrun/store.py, localrun/store_cli.py, localrun/hub.py, tests/test_selector.py."""

from __future__ import annotations

from localrun.formats import (  # noqa: F401 - re-exports
    BITS_PER_WEIGHT,
    GGUF_QUALITY_ORDER,
    KV_CACHE_BYTES,
    KV_CACHE_TYPES,
    SPLIT_SUFFIX,
    base_quant,
    bits_per_weight,
    kv_bytes_per_element,
    quality_rank,
    quant_from_filename,
)
