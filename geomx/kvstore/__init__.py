"""The key-value store API, with the MXNet/GeoMX KVStore semantics: ``kv = geomx.kvstore.create("dist_sync")``."""
from geomx.kvstore.kvstore import KVStore, create

__all__ = ["KVStore", "create"]
